//! `stable-harness init DIR`: write a starter workspace, then prove it validates.

use super::{InitArgs, exit, output};
use crate::workspace::{self, scaffold};

pub fn run(args: &InitArgs) -> u8 {
    let written = match scaffold::write(&args.dir) {
        Ok(written) => written,
        Err(error) => {
            output::error(&format!("stable-harness init: {error}"));
            return exit::USAGE;
        }
    };
    if let Err(diagnostics) = workspace::load(&args.dir) {
        output::error(&format!(
            "the scaffold did not validate (a bug):\n{diagnostics}"
        ));
        return exit::FAILED;
    }
    let dir = args.dir.display();
    output::print(&format!(
        "Created a workspace in {dir} ({} files).",
        written.len()
    ));
    output::print(&format!(
        "\nNext:\n  stable-harness validate -w {dir}\n  stable-harness start -w {dir}\n\n\
         The `greeter` agent works offline. The `assistant` agent calls the model at\n\
         $OPENAI_BASE_URL with $OPENAI_API_KEY (see config/catalogs/models.yaml)."
    ));
    exit::OK
}
