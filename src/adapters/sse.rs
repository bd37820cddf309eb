//! A minimal incremental Server-Sent Events decoder for upstream Chat Completions streams:
//! bytes in, the `data` of each complete event out.

/// Accumulates bytes and yields complete events' data (multi-line data joined with `\n`).
#[derive(Debug, Default)]
pub struct SseDecoder {
    buffer: Vec<u8>,
}

impl SseDecoder {
    /// Adds `bytes` and returns the data of every event they complete.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buffer.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some((end, separator)) = find_event_end(&self.buffer) {
            let block: Vec<u8> = self.buffer.drain(..end + separator).collect();
            let block = String::from_utf8_lossy(&block[..end]);
            let mut data: Option<String> = None;
            for line in block.split('\n') {
                let line = line.strip_suffix('\r').unwrap_or(line);
                if let Some(value) = line.strip_prefix("data:") {
                    let value = value.strip_prefix(' ').unwrap_or(value);
                    match &mut data {
                        Some(existing) => {
                            existing.push('\n');
                            existing.push_str(value);
                        }
                        None => data = Some(value.to_owned()),
                    }
                }
            }
            if let Some(data) = data {
                events.push(data);
            }
        }
        events
    }
}

/// Position and length of the first blank-line separator (`\n\n` or `\r\n\r\n`).
fn find_event_end(buffer: &[u8]) -> Option<(usize, usize)> {
    let mut index = 0;
    while index + 1 < buffer.len() {
        if buffer[index] == b'\n' {
            if buffer[index + 1] == b'\n' {
                return Some((index, 2));
            }
            if buffer[index + 1] == b'\r' && buffer.get(index + 2) == Some(&b'\n') {
                return Some((index, 3));
            }
        }
        index += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::SseDecoder;

    #[test]
    fn decodes_split_events_and_crlf() {
        let mut decoder = SseDecoder::default();
        assert!(decoder.feed(b"data: {\"a\"").is_empty());
        assert_eq!(
            decoder.feed(b":1}\n\n: keep-alive\n\ndata: [DONE]\r\n\r\n"),
            vec!["{\"a\":1}", "[DONE]"]
        );
        assert_eq!(
            decoder.feed(b"event: x\ndata: one\ndata: two\n\n"),
            vec!["one\ntwo"]
        );
        assert!(decoder.buffer.is_empty());
    }
}
