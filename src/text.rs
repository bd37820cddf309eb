//! Text helpers shared by the layers that quote foreign text (upstream bodies, tool output)
//! in their error messages.

/// At most 300 characters of `text`, trimmed, with `…` when cut.
pub fn excerpt(text: &str) -> String {
    let trimmed = text.trim();
    match trimmed.char_indices().nth(300) {
        Some((index, _)) => format!("{}…", &trimmed[..index]),
        None => trimmed.to_owned(),
    }
}
