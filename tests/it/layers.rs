//! The crate's layering, read from `src/`: every `crate::` / `super::` path names a module file;
//! top-level modules may only use modules of lower layers (so no import cycle between them), the
//! files of one folder form no cycle among themselves, and only `src/runtime/` uses `ort`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::util::repo;

/// Top-level modules, lowest layer first; a module may use only those of a lower layer.
const LAYERS: &[&[&str]] = &[
    &["error", "limits"],
    &["fsutil"],
    &["stages"],
    &["runtime"],
    &["bundle"],
    &["pipeline"],
    &["capi"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a library file: `src/bundle/manifest.rs` -> `["bundle", "manifest"]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    parts
}

/// The code of a file without comments and without its `#[cfg(test)]` module.
fn code_of(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The library modules (as paths) each library module uses through `crate::` and `super::` paths,
/// resolved to the longest prefix that is a module file.
fn module_uses() -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let src = repo().join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.retain(|f| !f.starts_with(src.join("bin")));
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(&src, f)).collect();
    let mut uses = BTreeMap::new();
    for file in &files {
        let module = module_of(&src, file);
        let code = code_of(&std::fs::read_to_string(file).unwrap());
        let mut used = BTreeSet::new();
        for (prefix, base) in [
            ("crate::", Vec::new()),
            ("super::", module[..module.len().saturating_sub(1)].to_vec()),
        ] {
            for (start, _) in code.match_indices(prefix) {
                let before = code[..start].chars().last();
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    continue;
                }
                let rest = &code[start + prefix.len()..];
                let mut path = base.clone();
                for segment in rest.split("::") {
                    let name: String = segment
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if name.is_empty() || !name.starts_with(|c: char| c.is_ascii_lowercase()) {
                        break;
                    }
                    path.push(name);
                    if segment.len() > path.last().map_or(0, String::len) {
                        break;
                    }
                }
                while !path.is_empty() && !modules.contains(&path) {
                    path.pop();
                }
                if path != module {
                    used.insert(path);
                }
            }
        }
        uses.insert(module, used);
    }
    uses
}

#[test]
fn top_level_modules_use_only_lower_layers() {
    let mut violations = Vec::new();
    for (module, used) in module_uses() {
        let Some(from) = module.first() else { continue };
        let from_layer = layer_of(from).unwrap_or_else(|| panic!("module {from} has no layer"));
        for target in used {
            let Some(to) = target.first() else { continue };
            if to == from {
                continue;
            }
            let to_layer = layer_of(to).unwrap_or_else(|| panic!("module {to} has no layer"));
            if to_layer >= from_layer {
                violations.push(format!("{} uses {}", module.join("::"), target.join("::")));
            }
        }
    }
    assert!(
        violations.is_empty(),
        "layering violations: {violations:#?}"
    );
}

#[test]
fn sibling_files_form_no_cycle() {
    let uses = module_uses();
    // Edges between files of one folder, ignoring the folder's own mod.rs (the parent).
    let edges = |module: &Vec<String>| -> Vec<Vec<String>> {
        uses[module]
            .iter()
            .filter(|t| t.len() == module.len() && t[..t.len() - 1] == module[..module.len() - 1])
            .cloned()
            .collect()
    };
    fn visit(
        node: &Vec<String>,
        edges: &dyn Fn(&Vec<String>) -> Vec<Vec<String>>,
        stack: &mut Vec<Vec<String>>,
        done: &mut BTreeSet<Vec<String>>,
    ) {
        if done.contains(node) {
            return;
        }
        if let Some(at) = stack.iter().position(|n| n == node) {
            let cycle: Vec<String> = stack[at..].iter().map(|n| n.join("::")).collect();
            panic!("import cycle: {}", cycle.join(" -> "));
        }
        stack.push(node.clone());
        for next in edges(node) {
            visit(&next, edges, stack, done);
        }
        stack.pop();
        done.insert(node.clone());
    }
    let mut done = BTreeSet::new();
    for module in uses.keys() {
        visit(module, &edges, &mut Vec::new(), &mut done);
    }
}

#[test]
fn only_the_runtime_module_uses_ort() {
    let src = repo().join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let users: Vec<String> = files
        .iter()
        .filter(|f| !f.starts_with(src.join("runtime")))
        .filter(|f| {
            let code = code_of(&std::fs::read_to_string(f).unwrap());
            code.match_indices("ort::").any(|(at, _)| {
                !code[..at]
                    .chars()
                    .last()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_')
            })
        })
        .map(|f| f.display().to_string())
        .collect();
    assert!(
        users.is_empty(),
        "files outside src/runtime/ use ort: {users:?}"
    );
}

/// The checker itself: a made-up upward use is a violation it reports.
#[test]
fn an_upward_use_would_be_reported() {
    assert!(layer_of("stages") < layer_of("pipeline"));
    let uses = module_uses();
    let stages_use_pipeline = uses
        .iter()
        .filter(|(m, _)| m.first().is_some_and(|f| f == "stages"))
        .any(|(_, used)| {
            used.iter()
                .any(|t| t.first().is_some_and(|f| f == "pipeline"))
        });
    assert!(!stages_use_pipeline);
    let manifest = vec!["bundle".to_string(), "manifest".to_string()];
    assert!(
        uses[&manifest].contains(&vec!["stages".to_string(), "tokenize".to_string()]),
        "the resolver sees `use crate::stages::tokenize::TokenizerSpec`: {:?}",
        uses[&manifest]
    );
}
