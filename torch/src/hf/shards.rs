//! How weights are cut into files: the shard plan of a model being written, and the shard
//! index of a folder being read.

use std::collections::BTreeMap;

use serde_json::Value;
use tch::Kind;

use super::{stored_dtype, WEIGHTS};
use crate::error::{Error, Result};
use crate::model::ParamSpec;

/// How a model's parameters are cut into weight files: whole blocks, in order, each file
/// up to `max_bytes` (a larger block gets a file of its own).
#[derive(Clone, Debug, PartialEq)]
pub struct ShardPlan {
    /// Each file's name and the blocks it holds.
    pub files: Vec<(String, Vec<usize>)>,
}

impl ShardPlan {
    /// Plans files for `blocks` (tied parameters take no space) at 4 bytes an element.
    pub fn new(blocks: &[Vec<ParamSpec>], max_bytes: u64) -> Self {
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut current = 0u64;
        for (block, specs) in blocks.iter().enumerate() {
            let bytes: u64 = specs
                .iter()
                .filter(|s| s.tied_to.is_none())
                .map(|s| 4 * s.numel() as u64)
                .sum();
            match groups.last_mut() {
                Some(group) if current + bytes <= max_bytes => {
                    group.push(block);
                    current += bytes;
                }
                _ => {
                    groups.push(vec![block]);
                    current = bytes;
                }
            }
        }
        let n = groups.len();
        let files = groups
            .into_iter()
            .enumerate()
            .map(|(i, blocks)| {
                let name = if n == 1 {
                    WEIGHTS.to_string()
                } else {
                    format!("model-{:05}-of-{n:05}.safetensors", i + 1)
                };
                (name, blocks)
            })
            .collect();
        Self { files }
    }

    /// `model.safetensors.index.json` for the plan (only needed with several files).
    #[cfg(test)]
    pub fn index(&self, blocks: &[Vec<ParamSpec>]) -> Value {
        self.index_as(blocks, Kind::Float)
    }

    /// The index of the files with every tensor written in `kind`.
    pub fn index_as(&self, blocks: &[Vec<ParamSpec>], kind: Kind) -> Value {
        let width = stored_dtype(kind).1;
        let mut weight_map = BTreeMap::new();
        let mut total = 0u64;
        for (file, members) in &self.files {
            for &block in members {
                for spec in blocks[block].iter().filter(|s| s.tied_to.is_none()) {
                    weight_map.insert(spec.name.clone(), file.clone());
                    total += width * spec.numel() as u64;
                }
            }
        }
        serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map })
    }
}

/// The shard files `model.safetensors.index.json` (bytes `index`, read from `path`) names.
pub(super) fn index_files(index: &[u8], path: &str) -> Result<Vec<String>> {
    let bad = |problem: &str| Error::ModelFile {
        path: path.to_string(),
        problem: problem.to_string(),
    };
    let value: Value = serde_json::from_slice(index).map_err(|e| bad(&format!("is not valid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("has no weight_map object"))?;
    let mut files: Vec<String> = map.values().filter_map(Value::as_str).map(str::to_string).collect();
    files.sort();
    files.dedup();
    if files.is_empty() || files.iter().any(|f| f.contains('/') || f.contains("..")) {
        return Err(bad("weight_map must name shard files in the same folder"));
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Init;

    fn block(sizes: &[i64]) -> Vec<ParamSpec> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, n)| ParamSpec::new(format!("p{n}.{i}"), &[*n], Init::Zeros))
            .collect()
    }

    #[test]
    fn shards_hold_whole_blocks_up_to_the_limit() {
        let blocks = vec![block(&[10]), block(&[5, 5]), block(&[30]), block(&[1])];
        let plan = ShardPlan::new(&blocks, 80);
        let groups: Vec<Vec<usize>> = plan.files.iter().map(|(_, b)| b.clone()).collect();
        assert_eq!(groups, vec![vec![0, 1], vec![2], vec![3]]);
        assert_eq!(plan.files[0].0, "model-00001-of-00003.safetensors");
        let index = plan.index(&blocks);
        assert_eq!(index["metadata"]["total_size"], 4 * 51);
        assert_eq!(index["weight_map"]["p30.0"], "model-00002-of-00003.safetensors");
        assert_eq!(ShardPlan::new(&blocks, 1 << 20).files[0].0, WEIGHTS);
    }
}
