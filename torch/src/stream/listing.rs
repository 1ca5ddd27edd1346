//! Listing a run's sources: every file under each folder or prefix in name order, Parquet
//! footers read for their row groups, files of other kinds named and ignored; then the
//! pure layout deals them to logical shards.

use regatta_object_store::Place;
use regatta_trainer::stream::{file_kind, DataPlan, FileEntry, FileKind, SourceListing};
use regatta_trainer::DataConfig;

use super::remote::Remote;
use crate::error::{Error, Result};

/// Lists every source of `data` (files in name order, Parquet footers read for their row
/// groups) and deals them to the logical shards.
pub async fn plan(data: &DataConfig, seed: u64) -> Result<DataPlan> {
    let mut listings = Vec::with_capacity(data.sources.len());
    for source in &data.sources {
        listings.push(list_source(&source.path, source.weight).await?);
    }
    Ok(DataPlan::new(listings, data.shards, seed, data.epochs)?)
}

async fn list_source(url: &str, weight: f64) -> Result<SourceListing> {
    let dir = Place::dir(url)?;
    let mut found = dir.list_all().await?;
    let mut base = url.trim_end_matches('/').to_string();
    if found.is_empty() && !url.ends_with('/') {
        // A single file.
        if let Ok((parent, name)) = Place::file(url) {
            if let Ok(size) = parent.size(&name).await {
                found.push((name, size));
                base = parent.url().to_string();
            }
        }
    }
    if found.is_empty() {
        return Err(Error::Dataset(format!(
            "{url}: no such file, folder or prefix (nothing is listed there)"
        )));
    }
    let place = Place::dir(&base)?;
    let mut files = Vec::new();
    let mut ignored = Vec::new();
    for (name, size) in found {
        let Some((kind, compression)) = file_kind(&name) else {
            ignored.push(name);
            continue;
        };
        let row_groups = if kind == FileKind::Parquet {
            let remote = Remote::new(place.clone(), name.clone(), size, tokio::runtime::Handle::current());
            let what = format!("{base}/{name}");
            tokio::task::spawn_blocking(move || {
                parquet::file::reader::SerializedFileReader::new(remote)
                    .map(|r| parquet::file::reader::FileReader::metadata(&r).num_row_groups() as u32)
            })
            .await
            .map_err(|e| Error::Dataset(format!("{what}: {e}")))?
            .map_err(|e| Error::Dataset(format!("{what} is not a readable Parquet file: {e}")))?
        } else {
            0
        };
        files.push(FileEntry {
            name,
            size,
            kind,
            compression,
            row_groups,
        });
    }
    if !ignored.is_empty() {
        eprintln!(
            "data: {base}: ignored {} file(s) that are not .jsonl/.json/.ndjson (plain, .zst, .gz) or .parquet: {}",
            ignored.len(),
            ignored.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
        );
    }
    Ok(SourceListing {
        url: base,
        weight,
        files,
    })
}
