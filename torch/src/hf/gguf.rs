//! A GGUF file opened as a model folder: its header read in growing pieces, its metadata
//! turned into `config.json` and tokenizer files, its tensors named as `transformers`
//! names them.

use std::collections::HashMap;

use bytes::Bytes;
use regatta_object_store::Place;
use regatta_trainer::gguf::{GgufError, GgufHeader, GgufModel};
use serde_json::Value;

use super::{Entry, HfModel};
use crate::error::{Error, Result};

/// Whether a model path names a GGUF file rather than a folder.
pub fn is_gguf(path: &str) -> bool {
    path.to_ascii_lowercase().ends_with(".gguf")
}

/// The first bytes read of a GGUF file; more are read while its header goes on.
const GGUF_FIRST_READ: u64 = 4 << 20;

impl HfModel {
    /// Opens a GGUF file: its header only (read in growing pieces until it parses), its
    /// metadata turned into `config.json`, tokenizer files and tensor names as
    /// `transformers` has them.
    pub(super) async fn open_gguf(url: &str) -> Result<Self> {
        let (place, file) = Place::file(url)?;
        let path = format!("{}/{file}", place.url());
        let size = place.size(&file).await.map_err(|e| Error::ModelFile {
            path: path.clone(),
            problem: format!("cannot be read: {e}"),
        })?;
        let bad = |e: GgufError| Error::ModelFile {
            path: path.clone(),
            problem: e.to_string(),
        };
        let mut read = GGUF_FIRST_READ.min(size);
        let header = loop {
            let bytes = place.get_range(&file, 0..read).await?;
            match GgufHeader::parse(&bytes, size) {
                Ok(header) => break header,
                Err(GgufError::Truncated { needed }) if read < size => {
                    read = needed.max(read.saturating_mul(2)).min(size);
                }
                Err(GgufError::Truncated { .. }) => {
                    return Err(bad(GgufError::Malformed(
                        "the header runs past the end of the file".into(),
                    )))
                }
                Err(e) => return Err(bad(e)),
            }
        };
        let model = GgufModel::from_header(&header).map_err(bad)?;
        let entries = model
            .tensors
            .into_iter()
            .map(|tensor| {
                let entry = Entry {
                    file: file.clone(),
                    dtype: tensor.info.kind.name().to_string(),
                    shape: tensor.info.shape(),
                    start: tensor.info.start,
                    end: tensor.info.end,
                    gguf: Some(tensor.clone()),
                    bnb: None,
                };
                (tensor.name, entry)
            })
            .collect();
        let json_bytes = |value: &Value| Bytes::from(serde_json::to_vec(value).unwrap_or_default());
        let mut files = HashMap::new();
        files.insert("tokenizer.json", model.tokenizer.map(|t| json_bytes(&t)));
        files.insert("tokenizer_config.json", Ok(json_bytes(&model.tokenizer_config)));
        Ok(Self {
            url: path,
            place,
            config_json: model.config,
            entries,
            gguf_files: Some(files),
        })
    }
}
