//! The crate's layering, read from `src/`: every `crate::` / `super::` path (grouped imports
//! included) names a module file; top-level modules may only use modules of lower layers (so no
//! import cycle between them), the files of one folder form no cycle among themselves (in the
//! library and in the `klein` binary), and only `src/runtime/` uses `ort`.

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
    &["capi", "api"],
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

/// The module path of a file of the crate rooted at `src`: `src/bundle/manifest.rs` ->
/// `["bundle", "manifest"]`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let relative = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    // mod.rs is its folder's module; lib.rs and a binary's main.rs are the crate's root.
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") || parts == ["main"] {
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

/// The paths a use tree starting at `rest` names, each relative to where it starts: `a::b::C` gives
/// `[a, b, C]`, `{a, b::{c, d}}` gives `[a]`, `[b, c]` and `[b, d]`. Segments after the first that
/// does not start with a lowercase letter (a type, a function call's parentheses) are dropped.
fn use_paths(rest: &str) -> Vec<Vec<String>> {
    fn tree(chars: &[char], at: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
        let mut path = prefix;
        loop {
            while chars.get(*at).is_some_and(|c| c.is_whitespace()) {
                *at += 1;
            }
            if chars.get(*at) == Some(&'{') {
                *at += 1;
                loop {
                    tree(chars, at, path.clone(), out);
                    while chars.get(*at).is_some_and(|c| c.is_whitespace()) {
                        *at += 1;
                    }
                    match chars.get(*at) {
                        Some(',') => *at += 1,
                        Some('}') => {
                            *at += 1;
                            return;
                        }
                        _ => return,
                    }
                    while chars.get(*at).is_some_and(|c| c.is_whitespace()) {
                        *at += 1;
                    }
                    if chars.get(*at) == Some(&'}') {
                        *at += 1;
                        return;
                    }
                }
            }
            let name: String = chars[*at..]
                .iter()
                .take_while(|c| c.is_alphanumeric() || **c == '_')
                .collect();
            *at += name.chars().count();
            if name.starts_with(|c: char| c.is_ascii_lowercase()) {
                path.push(name);
            } else {
                // A type, `self`'s capital cousins, or no name: the path ends before it.
                skip_rest_of_item(chars, at);
                out.push(path);
                return;
            }
            if chars[*at..].starts_with(&[':', ':']) {
                *at += 2;
            } else {
                skip_rest_of_item(chars, at);
                out.push(path);
                return;
            }
        }
    }
    /// Past the rest of one item of a group (`Type as Name`, a nested path of a type's members),
    /// up to the `,` or `}` that ends it at this depth.
    fn skip_rest_of_item(chars: &[char], at: &mut usize) {
        let mut depth = 0usize;
        while let Some(&c) = chars.get(*at) {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => return,
                '}' => depth -= 1,
                ',' if depth == 0 => return,
                ';' | '(' | ')' | '<' | '>' | '=' | '&' | '[' if depth == 0 => return,
                _ => {}
            }
            *at += 1;
        }
    }
    let chars: Vec<char> = rest.chars().collect();
    let mut out = Vec::new();
    tree(&chars, &mut 0, Vec::new(), &mut out);
    out
}

/// The modules (as paths) each module of the crate rooted at `root` uses through `crate::` and
/// `super::` paths, resolved to the longest prefix that is a module file. `skip`: folders of other
/// crates under `root` (the binaries under `src/bin` for the library).
fn crate_uses(root: &Path, skip: &[PathBuf]) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    files.retain(|f| !skip.iter().any(|s| f.starts_with(s)));
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(root, f)).collect();
    let mut uses = BTreeMap::new();
    for file in &files {
        let module = module_of(root, file);
        let code = code_of(&std::fs::read_to_string(file).unwrap());
        let mut used = BTreeSet::new();
        for (start, _) in code
            .match_indices("crate::")
            .chain(code.match_indices("super::"))
        {
            let before = code[..start].chars().last();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue; // part of a longer name, or a later `super::` of `super::super::`
            }
            let mut rest = &code[start..];
            let mut base = module.clone();
            if let Some(after) = rest.strip_prefix("crate::") {
                base.clear();
                rest = after;
            } else {
                // A file's own module is its parent's child: `super::` is the folder's module.
                while let Some(after) = rest.strip_prefix("super::") {
                    base.pop();
                    rest = after;
                }
            }
            for relative in use_paths(rest) {
                let mut path = base.clone();
                path.extend(relative);
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

/// The library's modules and what each uses.
fn module_uses() -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let src = repo().join("src");
    crate_uses(&src, &[src.join("bin")])
}

/// The `klein` binary's modules (`src/bin/klein`, rooted at its main.rs) and what each uses.
fn binary_uses() -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    crate_uses(&repo().join("src/bin/klein"), &[])
}

/// The first import cycle among the files of one folder of a crate, if any.
fn sibling_cycle(uses: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Option<String> {
    // Edges between files of one folder, ignoring the folder's own mod.rs (the parent).
    let edges = |module: &Vec<String>| -> Vec<Vec<String>> {
        uses[module]
            .iter()
            .filter(|t| {
                !module.is_empty()
                    && t.len() == module.len()
                    && t[..t.len() - 1] == module[..module.len() - 1]
            })
            .cloned()
            .collect()
    };
    fn visit(
        node: &Vec<String>,
        edges: &dyn Fn(&Vec<String>) -> Vec<Vec<String>>,
        stack: &mut Vec<Vec<String>>,
        done: &mut BTreeSet<Vec<String>>,
    ) -> Option<String> {
        if done.contains(node) {
            return None;
        }
        if let Some(at) = stack.iter().position(|n| n == node) {
            let cycle: Vec<String> = stack[at..].iter().map(|n| n.join("::")).collect();
            return Some(format!("{} -> {}", cycle.join(" -> "), node.join("::")));
        }
        stack.push(node.clone());
        for next in edges(node) {
            if let Some(cycle) = visit(&next, edges, stack, done) {
                return Some(cycle);
            }
        }
        stack.pop();
        done.insert(node.clone());
        None
    }
    let mut done = BTreeSet::new();
    uses.keys()
        .find_map(|module| visit(module, &edges, &mut Vec::new(), &mut done))
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
    for (name, uses) in [("library", module_uses()), ("klein binary", binary_uses())] {
        if let Some(cycle) = sibling_cycle(&uses) {
            panic!("import cycle in the {name}: {cycle}");
        }
    }
}

/// The checker itself: grouped imports are read as the modules they name, and a cycle between two
/// files of one folder is reported.
#[test]
fn grouped_imports_and_cycles_are_seen() {
    let names = |paths: Vec<Vec<String>>| -> Vec<String> {
        paths.into_iter().map(|p| p.join("::")).collect()
    };
    assert_eq!(
        names(use_paths(
            "{jobs::lock, metrics::{Metrics, render}, params};"
        )),
        ["jobs::lock", "metrics", "metrics::render", "params"]
    );
    assert_eq!(
        names(use_paths("stages::tokenize::TokenizerSpec;")),
        ["stages::tokenize"]
    );
    let module = |name: &str| vec!["serve".to_string(), name.to_string()];
    let mut uses = BTreeMap::new();
    uses.insert(module("jobs"), BTreeSet::from([module("metrics")]));
    uses.insert(module("metrics"), BTreeSet::from([module("jobs")]));
    assert_eq!(
        sibling_cycle(&uses).as_deref(),
        Some("serve::jobs -> serve::metrics -> serve::jobs")
    );
    uses.insert(module("metrics"), BTreeSet::new());
    assert_eq!(sibling_cycle(&uses), None);
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
