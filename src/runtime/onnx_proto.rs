//! Just enough of the ONNX protobuf to point some initializers of a graph at another
//! external-data file (how merged LoRA weights reach ONNX Runtime without a copy held in memory),
//! and to find the tables a graph only looks rows up in (which a prefetch need not read):
//! `ModelProto.graph` (7) -> `GraphProto.initializer` (5) -> `TensorProto` `name` (8),
//! `external_data` (13: `StringStringEntryProto` key 1, value 2), `data_location` (14, 1 = EXTERNAL);
//! `GraphProto.node` (1) -> `NodeProto` `input` (1), `op_type` (4). Every other field is copied byte
//! for byte.
use std::collections::{BTreeMap, BTreeSet};

type Fail = String;

/// One field: its number, wire type, and byte ranges (whole field from its key; value).
struct Field {
    number: u64,
    wire: u64,
    start: usize,
    value: (usize, usize),
}

fn varint(buf: &[u8], mut pos: usize) -> Result<(u64, usize), Fail> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *buf.get(pos).ok_or("protobuf: truncated varint")?;
        pos += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Ok((value, pos));
        }
    }
    Err("protobuf: varint longer than 10 bytes".into())
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// The fields of the message `buf[start..end]`.
fn fields(buf: &[u8], start: usize, end: usize) -> Result<Vec<Field>, Fail> {
    let mut out = Vec::new();
    let mut pos = start;
    while pos < end {
        let (key, after_key) = varint(buf, pos)?;
        let (number, wire) = (key >> 3, key & 7);
        let (value_start, value_end) = match wire {
            0 => (after_key, varint(buf, after_key)?.1),
            1 => (after_key, after_key + 8),
            2 => {
                let (len, after_len) = varint(buf, after_key)?;
                let len = usize::try_from(len).map_err(|e| e.to_string())?;
                (
                    after_len,
                    after_len
                        .checked_add(len)
                        .ok_or("protobuf: length overflows")?,
                )
            }
            5 => (after_key, after_key + 4),
            other => return Err(format!("protobuf: wire type {other} at byte {pos}")),
        };
        if value_end > end {
            return Err(format!("protobuf: field {number} runs past its message"));
        }
        out.push(Field {
            number,
            wire,
            start: pos,
            value: (value_start, value_end),
        });
        pos = value_end;
    }
    Ok(out)
}

fn put_bytes_field(out: &mut Vec<u8>, number: u64, bytes: &[u8]) {
    put_varint(out, number << 3 | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// `StringStringEntryProto { key, value }`.
fn entry(key: &str, value: &str) -> Vec<u8> {
    let mut out = Vec::new();
    put_bytes_field(&mut out, 1, key.as_bytes());
    put_bytes_field(&mut out, 2, value.as_bytes());
    out
}

/// The graph `model` with the initializers in `moved` (name -> offset, length) stored as external
/// data at those places of `location`, and the other external-data files the graph still reads.
pub fn redirect_initializers(
    model: &[u8],
    moved: &BTreeMap<String, (u64, u64)>,
    location: &str,
) -> Result<(Vec<u8>, BTreeSet<String>), Fail> {
    let mut others = BTreeSet::new();
    let mut found = BTreeSet::new();
    let mut out = Vec::with_capacity(model.len() + moved.len() * 64);
    for field in fields(model, 0, model.len())? {
        if field.number != 7 || field.wire != 2 {
            out.extend_from_slice(&model[field.start..field.value.1]);
            continue;
        }
        let mut graph = Vec::new();
        for g in fields(model, field.value.0, field.value.1)? {
            if g.number != 5 || g.wire != 2 {
                graph.extend_from_slice(&model[g.start..g.value.1]);
                continue;
            }
            let tensor = fields(model, g.value.0, g.value.1)?;
            let name = tensor
                .iter()
                .find(|t| t.number == 8 && t.wire == 2)
                .map(|t| String::from_utf8_lossy(&model[t.value.0..t.value.1]).into_owned());
            match name.as_ref().and_then(|n| moved.get(n).map(|m| (n, m))) {
                Some((name, &(offset, length))) => {
                    found.insert(name.clone());
                    let mut message = Vec::new();
                    for t in tensor.iter().filter(|t| t.number != 13 && t.number != 14) {
                        message.extend_from_slice(&model[t.start..t.value.1]);
                    }
                    put_bytes_field(&mut message, 13, &entry("location", location));
                    put_bytes_field(&mut message, 13, &entry("offset", &offset.to_string()));
                    put_bytes_field(&mut message, 13, &entry("length", &length.to_string()));
                    put_varint(&mut message, 14 << 3); // data_location = EXTERNAL
                    put_varint(&mut message, 1);
                    put_bytes_field(&mut graph, 5, &message);
                }
                None => {
                    for t in tensor.iter().filter(|t| t.number == 13 && t.wire == 2) {
                        let kv = fields(model, t.value.0, t.value.1)?;
                        let text = |n| {
                            kv.iter().find(|f| f.number == n).map(|f| {
                                String::from_utf8_lossy(&model[f.value.0..f.value.1]).into_owned()
                            })
                        };
                        if text(1).as_deref() == Some("location") {
                            others.extend(text(2));
                        }
                    }
                    graph.extend_from_slice(&model[g.start..g.value.1]);
                }
            }
        }
        put_bytes_field(&mut out, 7, &graph);
    }
    if let Some(missing) = moved.keys().find(|n| !found.contains(*n)) {
        return Err(format!("the graph has no initializer `{missing}`"));
    }
    Ok((out, others))
}

/// One external initializer's bytes: `location` (relative to the graph's folder), offset, length.
#[derive(Debug, PartialEq, Eq)]
pub struct ExternalBytes {
    pub location: String,
    pub offset: u64,
    pub length: u64,
}

/// The external initializers of `model`'s main graph that only `Gather` nodes read, and only as
/// their table (input 0): an embedding table, of which a run reads the rows of its tokens. Uses
/// inside subgraphs (`If`, `Loop` bodies) are not seen; the answer is for reading ahead, where a
/// table left out is only read later.
pub fn gather_tables(model: &[u8]) -> Result<Vec<ExternalBytes>, Fail> {
    let text = |f: &Field| String::from_utf8_lossy(&model[f.value.0..f.value.1]).into_owned();
    let mut tables = BTreeMap::new();
    // Initializer name -> whether every use seen so far is a Gather's table.
    let mut only_gathered: BTreeMap<String, bool> = BTreeMap::new();
    for field in fields(model, 0, model.len())? {
        if field.number != 7 || field.wire != 2 {
            continue;
        }
        for g in fields(model, field.value.0, field.value.1)? {
            match (g.number, g.wire) {
                (1, 2) => {
                    let node = fields(model, g.value.0, g.value.1)?;
                    let gather = node
                        .iter()
                        .any(|f| f.number == 4 && f.wire == 2 && text(f) == "Gather");
                    let inputs = node.iter().filter(|f| f.number == 1 && f.wire == 2);
                    for (index, input) in inputs.enumerate() {
                        let ok = only_gathered.entry(text(input)).or_insert(true);
                        *ok &= gather && index == 0;
                    }
                }
                (5, 2) => {
                    let tensor = fields(model, g.value.0, g.value.1)?;
                    let name = tensor.iter().find(|t| t.number == 8 && t.wire == 2);
                    let mut entries = BTreeMap::new();
                    for t in tensor.iter().filter(|t| t.number == 13 && t.wire == 2) {
                        let kv = fields(model, t.value.0, t.value.1)?;
                        let part = |n| kv.iter().find(|f| f.number == n).map(text);
                        if let (Some(key), Some(value)) = (part(1), part(2)) {
                            entries.insert(key, value);
                        }
                    }
                    let number = |key| entries.get(key).and_then(|v: &String| v.parse().ok());
                    if let (Some(name), Some(location), Some(offset), Some(length)) = (
                        name,
                        entries.get("location"),
                        number("offset"),
                        number("length"),
                    ) {
                        let bytes = ExternalBytes {
                            location: location.clone(),
                            offset,
                            length,
                        };
                        tables.insert(text(name), bytes);
                    }
                }
                _ => {}
            }
        }
    }
    Ok(tables
        .into_iter()
        .filter(|(name, _)| only_gathered.get(name) == Some(&true))
        .map(|(_, bytes)| bytes)
        .collect())
}

/// Small ONNX models for tests here and in [`super::prefetch`].
#[cfg(test)]
pub(crate) mod fixtures {
    use super::*;

    /// A node `op_type(inputs)`.
    pub fn node(op_type: &str, inputs: &[&str]) -> Vec<u8> {
        let mut n = Vec::new();
        for input in inputs {
            put_bytes_field(&mut n, 1, input.as_bytes());
        }
        put_bytes_field(&mut n, 4, op_type.as_bytes());
        n
    }

    /// A ModelProto whose graph holds `nodes` and two initializers in the file `location`: `a`
    /// (bytes 0-63) and `b` (64-95).
    pub fn model_with_nodes(nodes: &[Vec<u8>], location: &str) -> Vec<u8> {
        let tensor = |name: &str, offset: &str, length: &str| {
            let mut t = Vec::new();
            put_bytes_field(&mut t, 8, name.as_bytes());
            put_bytes_field(&mut t, 13, &entry("location", location));
            put_bytes_field(&mut t, 13, &entry("offset", offset));
            put_bytes_field(&mut t, 13, &entry("length", length));
            put_varint(&mut t, 14 << 3);
            put_varint(&mut t, 1);
            t
        };
        let mut graph = Vec::new();
        for n in nodes {
            put_bytes_field(&mut graph, 1, n);
        }
        put_bytes_field(&mut graph, 5, &tensor("a", "0", "64"));
        put_bytes_field(&mut graph, 5, &tensor("b", "64", "32"));
        let mut model = Vec::new();
        put_bytes_field(&mut model, 7, &graph);
        model
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::fixtures::{model_with_nodes, node};
    use super::*;

    /// A ModelProto with an ir_version, a graph holding two initializers (one external), and a
    /// trailing opset field.
    fn model() -> Vec<u8> {
        let tensor = |name: &str, external: bool| {
            let mut t = Vec::new();
            put_varint(&mut t, 1 << 3); // dims 2
            put_varint(&mut t, 2);
            put_bytes_field(&mut t, 8, name.as_bytes());
            if external {
                put_bytes_field(&mut t, 13, &entry("location", "w.data"));
                put_bytes_field(&mut t, 13, &entry("offset", "0"));
                put_varint(&mut t, 14 << 3);
                put_varint(&mut t, 1);
            }
            t
        };
        let mut graph = Vec::new();
        put_bytes_field(&mut graph, 5, &tensor("a", true));
        put_bytes_field(&mut graph, 5, &tensor("b", true));
        put_bytes_field(&mut graph, 2, b"graph-name");
        let mut model = Vec::new();
        put_varint(&mut model, 1 << 3);
        put_varint(&mut model, 10);
        put_bytes_field(&mut model, 7, &graph);
        put_bytes_field(&mut model, 8, b"opset");
        model
    }

    #[test]
    fn finds_the_tables_only_gather_reads() {
        let a = ExternalBytes {
            location: "w.data".into(),
            offset: 0,
            length: 64,
        };
        // `b` is also a MatMul's weight.
        let model = model_with_nodes(
            &[
                node("Gather", &["a", "ids"]),
                node("Gather", &["b", "ids"]),
                node("MatMul", &["x", "b"]),
            ],
            "w.data",
        );
        assert_eq!(gather_tables(&model).unwrap(), vec![a]);
        // `a` is also a Gather's indices.
        let model = model_with_nodes(
            &[node("Gather", &["a", "ids"]), node("Gather", &["t", "a"])],
            "w.data",
        );
        assert_eq!(gather_tables(&model).unwrap(), vec![]);
        // An initializer no node reads is not a table.
        assert_eq!(
            gather_tables(&model_with_nodes(&[], "w.data")).unwrap(),
            vec![]
        );
        assert!(gather_tables(&[0x0a, 0xff]).is_err());
    }

    #[test]
    fn moves_one_initializer_and_keeps_everything_else() {
        let model = model();
        let moved = BTreeMap::from([("b".to_string(), (65536, 8))]);
        let (rewritten, others) = redirect_initializers(&model, &moved, "lora.data").unwrap();
        assert_eq!(others, BTreeSet::from(["w.data".to_string()]));
        let text = String::from_utf8_lossy(&rewritten);
        assert!(
            text.contains("lora.data") && text.contains("65536") && text.contains("graph-name")
        );
        assert!(rewritten.ends_with(b"opset"));
        // The rewritten graph parses, and `a` is untouched.
        let top = fields(&rewritten, 0, rewritten.len()).unwrap();
        let graph = top.iter().find(|f| f.number == 7).unwrap();
        let inits: Vec<Field> = fields(&rewritten, graph.value.0, graph.value.1)
            .unwrap()
            .into_iter()
            .filter(|f| f.number == 5)
            .collect();
        assert_eq!(inits.len(), 2);
        let original_a = &model[..];
        let a = &rewritten[inits[0].value.0..inits[0].value.1];
        assert!(original_a.windows(a.len()).any(|w| w == a));
        let missing = BTreeMap::from([("c".to_string(), (0, 8))]);
        assert!(redirect_initializers(&model, &missing, "x")
            .unwrap_err()
            .contains("`c`"));
    }
}
