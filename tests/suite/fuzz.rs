//! Fuzzing the workspace loader with proptest: `stable_harness::workspace::load` on workspaces
//! whose `config/*.yaml` hold arbitrary text, or the example workspace's documents mutated
//! (bytes flipped, cut short, lines duplicated or moved, deep nesting, long strings, anchors and
//! aliases, markers). Loading never panics and gives either a workspace or diagnostics that each
//! name a file, with a line whenever they are about a file's content.
//!
//! Few cases by default so `cargo test` stays fast; a full run:
//! `PROPTEST_CASES=20000 cargo test --test suite fuzz` (the adapters' decoders: `cargo test --lib
//! adapters` with the same variable). A failing case is shrunk and printed, and its seed is saved
//! under `proptest-regressions/` to be replayed first next time.

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use stable_harness::workspace::Diagnostics;

use crate::helpers::{TestWorkspace, example_workspace};

/// Cases per property when `PROPTEST_CASES` is not set.
const DEFAULT_CASES: u32 = 96;

fn config() -> ProptestConfig {
    let mut config = ProptestConfig::default();
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = DEFAULT_CASES;
    }
    config
}

/// Every file of the example workspace: its path relative to the root, and its bytes.
fn example_files() -> Vec<(PathBuf, Vec<u8>)> {
    fn walk(root: &Path, dir: &Path, files: &mut Vec<(PathBuf, Vec<u8>)>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, files);
            } else {
                let relative = path.strip_prefix(root).unwrap().to_owned();
                files.push((relative, std::fs::read(&path).unwrap()));
            }
        }
    }
    let root = example_workspace();
    let mut files = Vec::new();
    walk(&root, &root, &mut files);
    files.sort();
    files
}

fn example_yaml_paths() -> Vec<PathBuf> {
    example_files()
        .into_iter()
        .map(|(path, _)| path)
        .filter(|path| path.extension().is_some_and(|e| e == "yaml"))
        .collect()
}

/// A copy of the example workspace (scripts keep their mode: tools point at them).
fn example_copy() -> TestWorkspace {
    let workspace = TestWorkspace::empty();
    for (relative, bytes) in example_files() {
        let path = workspace.write(relative.to_str().unwrap(), bytes);
        let mode = std::fs::metadata(example_workspace().join(&relative))
            .unwrap()
            .permissions();
        std::fs::set_permissions(path, mode).unwrap();
    }
    workspace
}

/// Loads the workspace and checks the loader's promise: no panic (a panic fails the case),
/// and every diagnostic names a file, with a position when it is about a file's content.
fn load_and_check(workspace: &TestWorkspace) -> Result<(), TestCaseError> {
    let diagnostics: Diagnostics = match stable_harness::workspace::load(workspace.path()) {
        Ok(_) => return Ok(()),
        Err(diagnostics) => diagnostics,
    };
    prop_assert!(!diagnostics.is_empty(), "an error without a diagnostic");
    for diagnostic in diagnostics.iter() {
        prop_assert!(!diagnostic.file.is_empty(), "{diagnostic}");
        // A folder (`config/`) is judged as a whole: "no Runtime document found".
        if !diagnostic.file.ends_with('/') {
            prop_assert!(
                diagnostic.line.is_some_and(|line| line >= 1)
                    && diagnostic.column.is_some_and(|column| column >= 1),
                "a diagnostic about a file without a position: {diagnostic}"
            );
        }
        prop_assert!(!diagnostic.message.trim().is_empty(), "{diagnostic:?}");
    }
    Ok(())
}

/// One edit of a YAML file's bytes; positions are taken modulo the file's length.
#[derive(Debug, Clone)]
enum Mutation {
    FlipByte {
        at: prop::sample::Index,
        mask: u8,
    },
    Truncate {
        at: prop::sample::Index,
    },
    DuplicateLine {
        line: prop::sample::Index,
    },
    SwapLines {
        a: prop::sample::Index,
        b: prop::sample::Index,
    },
    Insert {
        at: prop::sample::Index,
        text: Vec<u8>,
    },
    /// A line of `depth` nested flow sequences or mappings, or of indented block mappings.
    Nest {
        line: prop::sample::Index,
        depth: usize,
        style: u8,
    },
    LongString {
        at: prop::sample::Index,
        len: usize,
    },
}

/// Fragments that mean something to YAML or to our loader.
fn yaml_token() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(&b"\n---\n"[..]),
        Just(&b"---"[..]),
        Just(&b"\n...\n"[..]),
        Just(&b"%YAML 1.2\n"[..]),
        Just(&b"&a "[..]),
        Just(&b"*a"[..]),
        Just(&b"<<: *a\n"[..]),
        Just(&b"!!binary "[..]),
        Just(&b"!custom "[..]),
        Just(&b"? "[..]),
        Just(&b": "[..]),
        Just(&b"- "[..]),
        Just(&b"\t"[..]),
        Just(&b"  "[..]),
        Just(&b"{"[..]),
        Just(&b"}"[..]),
        Just(&b"["[..]),
        Just(&b"]"[..]),
        Just(&b"\""[..]),
        Just(&b"'"[..]),
        Just(&b"|\n"[..]),
        Just(&b">-\n"[..]),
        Just(&b"# comment\n"[..]),
        Just(&b"kind: Agent\n"[..]),
        Just(&b"kind: Runtime\n"[..]),
        Just(&b"apiVersion: stable-harness/v1\n"[..]),
        Just(&b"metadata: { name: x }\n"[..]),
        Just(&b"spec: {}\n"[..]),
        Just(&b"timeout: 99999999999d\n"[..]),
        Just(&b"maxAttempts: 18446744073709551616\n"[..]),
        Just(&b"- 1e400\n"[..]),
        Just(&b"\xEF\xBB\xBF"[..]),
        Just(&b"\xFF\xFE"[..]),
        Just(&b"\0"[..]),
        Just("é€😀".as_bytes()),
    ]
    .prop_map(<[u8]>::to_vec)
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let index = any::<prop::sample::Index>;
    prop_oneof![
        3 => (index(), 1u8..=255).prop_map(|(at, mask)| Mutation::FlipByte { at, mask }),
        1 => index().prop_map(|at| Mutation::Truncate { at }),
        2 => index().prop_map(|line| Mutation::DuplicateLine { line }),
        2 => (index(), index()).prop_map(|(a, b)| Mutation::SwapLines { a, b }),
        4 => (index(), prop_oneof![
            yaml_token(),
            proptest::collection::vec(any::<u8>(), 1..16),
        ])
            .prop_map(|(at, text)| Mutation::Insert { at, text }),
        1 => (index(), prop_oneof![1usize..100, 100usize..5000], any::<u8>())
            .prop_map(|(line, depth, style)| Mutation::Nest { line, depth, style }),
        1 => (index(), prop_oneof![1usize..1000, 10_000usize..300_000])
            .prop_map(|(at, len)| Mutation::LongString { at, len }),
    ]
}

/// Byte offsets where each line starts, and the end.
fn line_starts(bytes: &[u8]) -> Vec<usize> {
    let mut starts = vec![0];
    starts.extend(
        bytes
            .iter()
            .enumerate()
            .filter(|(_, b)| **b == b'\n')
            .map(|(i, _)| i + 1),
    );
    if starts.last() != Some(&bytes.len()) {
        starts.push(bytes.len());
    }
    starts
}

fn apply(bytes: &mut Vec<u8>, mutation: &Mutation) {
    let lines = line_starts(bytes);
    let line_range = |index: &prop::sample::Index| {
        let line = index.index(lines.len().saturating_sub(1).max(1));
        let start = lines.get(line).copied().unwrap_or(0);
        let end = lines.get(line + 1).copied().unwrap_or(bytes.len());
        start..end.max(start)
    };
    match mutation {
        Mutation::FlipByte { at, mask } => {
            if !bytes.is_empty() {
                let at = at.index(bytes.len());
                bytes[at] ^= mask;
            }
        }
        Mutation::Truncate { at } => bytes.truncate(at.index(bytes.len() + 1)),
        Mutation::DuplicateLine { line } => {
            let range = line_range(line);
            let copy = bytes[range.clone()].to_vec();
            bytes.splice(range.start..range.start, copy);
        }
        Mutation::SwapLines { a, b } => {
            let (a, b) = (line_range(a), line_range(b));
            let (first, second) = if a.start <= b.start { (a, b) } else { (b, a) };
            if first.end <= second.start {
                let second_bytes = bytes[second.clone()].to_vec();
                let first_bytes = bytes[first.clone()].to_vec();
                bytes.splice(second, first_bytes);
                bytes.splice(first, second_bytes);
            }
        }
        Mutation::Insert { at, text } => {
            let at = at.index(bytes.len() + 1);
            bytes.splice(at..at, text.iter().copied());
        }
        Mutation::Nest { line, depth, style } => {
            let nested = match style % 3 {
                0 => format!("x: {}1{}\n", "[".repeat(*depth), "]".repeat(*depth)),
                1 => format!("x: {}1{}\n", "{a: ".repeat(*depth), "}".repeat(*depth)),
                _ => (0..*depth.min(&400))
                    .map(|level| format!("{}k{level}:\n", " ".repeat(level)))
                    .collect(),
            };
            let at = line_range(line).start;
            bytes.splice(at..at, nested.into_bytes());
        }
        Mutation::LongString { at, len } => {
            let at = at.index(bytes.len() + 1);
            bytes.splice(at..at, std::iter::repeat_n(b'z', *len));
        }
    }
}

/// Arbitrary text for a whole file: YAML-ish tokens and raw bytes in any order.
fn arbitrary_file() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(
            prop_oneof![
                3 => yaml_token(),
                1 => "[a-zA-Z0-9 ]{0,12}".prop_map(String::into_bytes),
                1 => proptest::collection::vec(any::<u8>(), 0..8),
            ],
            0..80,
        )
        .prop_map(|pieces| pieces.concat()),
        proptest::collection::vec(any::<u8>(), 0..512),
        ".{0,512}".prop_map(String::into_bytes),
    ]
}

proptest! {
    #![proptest_config(config())]

    /// The example workspace with one or two of its YAML files mutated.
    #[test]
    fn fuzz_mutated_example_workspace_never_panics(
        edits in proptest::collection::vec(
            (any::<prop::sample::Index>(), proptest::collection::vec(mutation(), 1..4)),
            1..3,
        )
    ) {
        let workspace = example_copy();
        let yaml = example_yaml_paths();
        for (file, mutations) in &edits {
            let relative = &yaml[file.index(yaml.len())];
            let path = workspace.path().join(relative);
            let mut bytes = std::fs::read(&path).unwrap();
            for mutation in mutations {
                apply(&mut bytes, mutation);
            }
            std::fs::write(&path, bytes).unwrap();
        }
        load_and_check(&workspace)?;
    }

    /// A workspace whose `config/` holds only arbitrary files.
    #[test]
    fn fuzz_arbitrary_config_files_never_panic(
        files in proptest::collection::vec(
            (prop_oneof![
                Just("runtime/workspace.yaml"),
                Just("agents/a.yaml"),
                Just("catalogs/models.yml"),
                Just("x.yaml"),
            ], arbitrary_file()),
            1..4,
        )
    ) {
        let workspace = TestWorkspace::empty();
        for (name, bytes) in &files {
            workspace.write(&format!("config/{name}"), bytes);
        }
        load_and_check(&workspace)?;
    }
}

/// The mutations above do change what the loader sees: the unmutated copy loads, and a
/// known-bad edit is reported with its file and line (so the properties are not vacuous).
#[test]
fn fuzz_baseline_the_copy_loads_and_a_flip_is_located() {
    let workspace = example_copy();
    stable_harness::workspace::load(workspace.path())
        .unwrap_or_else(|d| panic!("the example copy does not load:\n{d}"));

    let path = workspace.path().join("config/agents/greeter.yaml");
    let mut bytes = std::fs::read(&path).unwrap();
    let lines = line_starts(&bytes);
    // A NUL at the start of the third line.
    bytes.insert(lines[2], 0);
    std::fs::write(&path, bytes).unwrap();
    let diagnostics = workspace.diagnostics();
    assert!(
        diagnostics
            .iter()
            .any(|d| d.starts_with("config/agents/greeter.yaml:3:")),
        "{diagnostics:?}"
    );
}
