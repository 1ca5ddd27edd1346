//! The dataset as a rank reads it, through `object_store`: only its own partitions.
//! A text file is one token stream (bytes are tokens by default; with a Hugging Face
//! `tokenizer.json` each partition's byte range is tokenized by the rank that owns it).
//! JSONL (split by byte ranges, a line belonging to the range it starts in) and Parquet
//! (split by rows) hold documents: `text`, `prompt`/`response` or chat `messages`, turned
//! into token ids with loss marks by [`regatta_trainer::documents`] and packed into rows
//! whose attention and loss stay inside each document.

use regatta_scorer::{byte_ranges, read_owned_lines};
use regatta_trainer::eval::Holdout;
use regatta_trainer::DataFormat;
use regatta_trainer::{chunks, DataLayout, BYTE_VOCAB};
use regatta_trainer::{Document, Packed, Record, TokenizerSettings};
use tch::{Kind, Tensor};

use crate::error::{Error, Result};

use regatta_object_store::Place;

/// How text becomes token ids.
pub enum TextTokenizer {
    /// Every byte is a token.
    Bytes,
    /// A Hugging Face tokenizer.
    Hf(Box<tokenizers::Tokenizer>),
}

impl TextTokenizer {
    /// Loads `tokenizer.json` from a path or URL; an empty spec means bytes.
    /// A GGUF file's vocabulary counts as its `tokenizer.json`.
    pub async fn load(spec: &str) -> Result<Self> {
        if spec.is_empty() {
            return Ok(Self::Bytes);
        }
        Self::from_json(&tokenizer_json(spec).await?, spec)
    }

    /// A tokenizer from the bytes of a `tokenizer.json`; `what` names it in errors.
    pub fn from_json(bytes: &[u8], what: &str) -> Result<Self> {
        let tokenizer = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| Error::Dataset(format!("{what} is not a valid tokenizer.json: {e}")))?;
        Ok(Self::Hf(Box::new(tokenizer)))
    }

    /// Token ids the model must embed.
    pub fn vocab(&self) -> usize {
        match self {
            Self::Bytes => BYTE_VOCAB,
            Self::Hf(t) => t.get_vocab_size(true),
        }
    }

    /// Token ids of some text (invalid UTF-8 is replaced for a tokenizer).
    pub fn encode(&self, text: &[u8]) -> Result<Vec<i64>> {
        match self {
            Self::Bytes => Ok(text.iter().map(|b| i64::from(*b)).collect()),
            Self::Hf(t) => {
                let text = String::from_utf8_lossy(text);
                let encoding = t
                    .encode(text.as_ref(), false)
                    .map_err(|e| Error::Dataset(format!("cannot tokenize: {e}")))?;
                Ok(encoding.get_ids().iter().map(|id| i64::from(*id)).collect())
            }
        }
    }

    /// Token ids of `text`, each with the byte offset in `text` where its piece starts.
    pub fn encode_with_offsets(&self, text: &str) -> Result<Vec<(i64, usize)>> {
        match self {
            Self::Bytes => Ok(text.bytes().enumerate().map(|(at, b)| (i64::from(b), at)).collect()),
            Self::Hf(t) => {
                let encoding = t
                    .encode(text, false)
                    .map_err(|e| Error::Dataset(format!("cannot tokenize: {e}")))?;
                Ok(encoding
                    .get_ids()
                    .iter()
                    .zip(encoding.get_offsets())
                    .map(|(id, (start, _))| (i64::from(*id), *start))
                    .collect())
            }
        }
    }

    /// Text of some token ids.
    pub fn decode(&self, ids: &[i64]) -> String {
        match self {
            Self::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|id| (*id).clamp(0, 255) as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            }
            Self::Hf(t) => {
                let ids: Vec<u32> = ids.iter().map(|id| (*id).max(0) as u32).collect();
                t.decode(&ids, true).unwrap_or_default()
            }
        }
    }
}

/// The bytes of the `tokenizer.json` at `spec`, or the one a GGUF file's metadata makes.
pub async fn tokenizer_json(spec: &str) -> Result<bytes::Bytes> {
    if crate::hf::is_gguf(spec) {
        let model = crate::hf::HfModel::open(spec).await?;
        return model.file("tokenizer.json").await?.ok_or_else(|| Error::ModelFile {
            path: spec.to_string(),
            problem: "makes no tokenizer.json".into(),
        });
    }
    let (place, name) = Place::file(spec)?;
    place.get(&name).await.map_err(Error::from)
}

/// One loaded partition: a slice of a text stream, or packed document rows.
enum Part {
    /// Token ids and the sequences they make.
    Stream(Vec<i64>, usize),
    /// Documents packed into rows.
    Packed(Packed),
}

impl Part {
    fn sequences(&self) -> usize {
        match self {
            Self::Stream(_, sequences) => *sequences,
            Self::Packed(packed) => packed.rows(),
        }
    }
}

/// The partitions one process trains on (one for a rank; all of them for the
/// single-process reference run).
pub struct RankData {
    context: usize,
    loaded: Vec<Part>,
    /// Whether rows are packed documents (attention stays inside each).
    documents: bool,
}

/// Where partition `p` of a dataset is and how it reads.
pub struct DataSource<'a> {
    /// The dataset's path or URL.
    pub path: &'a str,
    /// How it reads.
    pub format: DataFormat,
    /// Text to token ids.
    pub tokenizer: &'a TextTokenizer,
    /// Special tokens and chat template for document rows.
    pub settings: &'a TokenizerSettings,
    /// A split of JSONL or Parquet rows between training and validation: only this side's
    /// rows are read (`None`: every row).
    pub holdout: Option<Holdout>,
}

impl RankData {
    /// Reads partitions `which` of `partitions` of `source`.
    pub async fn load(source: &DataSource<'_>, context: usize, partitions: usize, which: &[usize]) -> Result<Self> {
        if let Some(&p) = which.iter().find(|&&p| p >= partitions) {
            return Err(Error::Dataset(format!("partition {p} of {partitions} does not exist")));
        }
        let path = source.path;
        let format = source.format.resolve(path);
        let mut loaded = Vec::with_capacity(which.len());
        for &p in which {
            let part = match format {
                DataFormat::Jsonl | DataFormat::Parquet => {
                    let records = if format == DataFormat::Jsonl {
                        jsonl_records(path, partitions, p, source.holdout).await?
                    } else {
                        parquet_records(path, partitions, p, source.holdout).await?
                    };
                    let documents = records
                        .iter()
                        .map(|(at, record)| {
                            document(source, record).map_err(|e| Error::Dataset(format!("{path}: {at}: {e}")))
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Part::Packed(Packed::new(&documents, context))
                }
                DataFormat::Text | DataFormat::Auto => {
                    text_part(path, source.tokenizer, context, partitions, p).await?
                }
            };
            if part.sequences() == 0 {
                return Err(Error::Dataset(format!(
                    "partition {p} of {partitions} of {path} fills no sequence of {} tokens; use fewer ranks, a \
                     shorter context or more data",
                    context + 1
                )));
            }
            loaded.push(part);
        }
        Ok(Self {
            context,
            loaded,
            documents: format != DataFormat::Text,
        })
    }

    /// Sequences in each loaded partition.
    pub fn sequences(&self) -> Vec<usize> {
        self.loaded.iter().map(Part::sequences).collect()
    }

    /// Inputs, targets and documents of the first partition's rows `picks`, in order; a
    /// `None` is a row that carries no loss (the first row with every target
    /// [`crate::engine::IGNORE_INDEX`]), filling a batch to its size.
    pub fn rows(&self, picks: &[Option<usize>]) -> (Tensor, Tensor, Option<Tensor>) {
        let mut rows = Rows::default();
        if let Some(part) = self.loaded.first() {
            for pick in picks {
                let from = rows.targets.len();
                rows.push(
                    part,
                    pick.unwrap_or(0).min(part.sequences().saturating_sub(1)),
                    0,
                    self.context,
                );
                if pick.is_none() {
                    rows.targets[from..].fill(crate::engine::IGNORE_INDEX);
                }
            }
        }
        rows.tensors(self.context, self.documents)
    }

    /// Inputs, targets (`[n, context]` token ids; [`crate::engine::IGNORE_INDEX`] where no loss) and, for
    /// packed documents, each input's document, of the batch at `position`:
    /// `per_partition` sequences from each loaded partition, in partition order, wrapping
    /// at its end.
    pub fn batch(&self, position: u64, per_partition: usize) -> (Tensor, Tensor, Option<Tensor>) {
        let mut rows = Rows::default();
        for (number, part) in self.loaded.iter().enumerate() {
            for j in 0..per_partition as u64 {
                let index = ((position + j) % part.sequences() as u64) as usize;
                rows.push(part, index, number as i64, self.context);
            }
        }
        rows.tensors(self.context, self.documents)
    }
}

/// Rows gathered for a batch, flat: inputs, targets and each input's document.
#[derive(Default)]
struct Rows {
    inputs: Vec<i64>,
    targets: Vec<i64>,
    documents: Vec<i64>,
}

impl Rows {
    /// Appends row `index` of `part` (rows of `context` tokens); partition `number`'s
    /// documents are numbered apart from other partitions'.
    fn push(&mut self, part: &Part, index: usize, number: i64, context: usize) {
        match part {
            Part::Stream(tokens, _) => {
                let sequence = &tokens[index * context..index * context + context + 1];
                self.inputs.extend_from_slice(&sequence[..context]);
                self.targets.extend_from_slice(&sequence[1..]);
            }
            Part::Packed(packed) => {
                let row = packed.row(index);
                self.inputs.extend(row.inputs);
                self.targets.extend(row.targets);
                self.documents.extend(row.documents.iter().map(|d| d + (number << 32)));
            }
        }
    }

    /// The rows as `[n, context]` tensors (documents only for packed rows).
    fn tensors(self, context: usize, documents: bool) -> (Tensor, Tensor, Option<Tensor>) {
        let shape = [(self.inputs.len() / context.max(1)) as i64, context as i64];
        let tensor = |values: &[i64]| Tensor::from_slice(values).view(shape).to_kind(Kind::Int64);
        (
            tensor(&self.inputs),
            tensor(&self.targets),
            documents.then(|| tensor(&self.documents)),
        )
    }
}

/// A record's token ids, each marked with whether it carries loss.
fn document(source: &DataSource<'_>, record: &Record) -> Result<Document> {
    encode_record(source.tokenizer, source.settings, record)
}

/// A record's token ids through `tokenizer`, each marked with whether it carries loss
/// (BOS, EOS and chat turns as `settings` say). The record's text is tokenized whole, as
/// `apply_chat_template(..., tokenize=True)` does (pieces tokenized apart can merge
/// differently at their seams: "\n\n" ending a chat header, "." before "</s>"); a token
/// carries loss when the piece it starts in does.
pub fn encode_record(tokenizer: &TextTokenizer, settings: &TokenizerSettings, record: &Record) -> Result<Document> {
    let segments = settings.segments(record).map_err(regatta_trainer::Error::from)?;
    let mut text = String::new();
    let mut learned = Vec::new();
    for segment in &segments {
        if segment.loss {
            learned.push(text.len()..text.len() + segment.text.len());
        }
        text.push_str(&segment.text);
    }
    let mut document = Document::default();
    for (id, start) in tokenizer.encode_with_offsets(&text)? {
        document.push(&[id], learned.iter().any(|span| span.contains(&start)));
    }
    Ok(document)
}

/// Partition `p` of `partitions` of a text stream: a slice of the file's bytes, as tokens.
async fn text_part(path: &str, tokenizer: &TextTokenizer, context: usize, partitions: usize, p: usize) -> Result<Part> {
    let (place, name) = Place::file(path)?;
    let size = place.size(&name).await?;
    let (range, sequences) = match tokenizer {
        TextTokenizer::Bytes => {
            let layout = DataLayout::new(size, context, partitions)?;
            (layout.token_range(p), layout.partitions[p].len())
        }
        TextTokenizer::Hf(_) => {
            let r = &chunks(size as usize, partitions.max(1))[p];
            (r.start as u64..r.end as u64, 0)
        }
    };
    let bytes = place.get_range(&name, range).await?;
    let tokens = tokenizer.encode(&bytes)?;
    let sequences = if sequences > 0 {
        sequences
    } else {
        tokens.len().saturating_sub(1) / context.max(1)
    };
    Ok(Part::Stream(tokens, sequences))
}

/// The rows of partition `p` of a JSONL file (the lines starting in its byte range), each
/// with where it starts. A line that is not a usable row is an error naming its offset:
/// training never skips data silently.
async fn jsonl_records(
    path: &str,
    partitions: usize,
    p: usize,
    holdout: Option<Holdout>,
) -> Result<Vec<(String, Record)>> {
    let (place, name) = Place::file(path)?;
    let size = place.size(&name).await?;
    let ranges = byte_ranges(size, partitions);
    let Some(range) = ranges.get(p).cloned() else {
        return Err(Error::Dataset(format!(
            "{path} ({size} bytes) is too small to split into {partitions} partitions"
        )));
    };
    let lines = read_owned_lines(&place, &name, size, range)
        .await
        .map_err(|e| match e {
            regatta_scorer::Error::Place(e) => Error::Place(e),
            other => Error::Dataset(format!("{path}: {other}")),
        })?;
    let mut records = Vec::with_capacity(lines.len());
    for (offset, line) in lines {
        if holdout.is_some_and(|h| !h.keeps(offset)) {
            continue;
        }
        let at = format!("the line at byte {offset}");
        let value: serde_json::Value = serde_json::from_slice(&line)
            .map_err(|e| Error::Dataset(format!("{path}: {at} is not valid JSON: {e}")))?;
        let record = Record::parse(&value).map_err(|e| Error::Dataset(format!("{path}: {at}: {e}")))?;
        records.push((at, record));
    }
    Ok(records)
}

/// The rows of partition `p` of a Parquet file (an even share of its rows), read from the
/// columns `text`, `prompt`/`response` or `messages`.
async fn parquet_records(
    path: &str,
    partitions: usize,
    p: usize,
    holdout: Option<Holdout>,
) -> Result<Vec<(String, Record)>> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let (place, name) = Place::file(path)?;
    let bytes = place.get(&name).await?;
    let not_parquet =
        |e: parquet::errors::ParquetError| Error::Dataset(format!("{path} is not a readable Parquet file: {e}"));
    let reader = SerializedFileReader::new(bytes).map_err(not_parquet)?;
    let rows = usize::try_from(reader.metadata().file_metadata().num_rows()).unwrap_or(0);
    let mine = chunks(rows, partitions.max(1)).get(p).cloned().ok_or_else(|| {
        Error::Dataset(format!(
            "{path} ({rows} rows) is too small to split into {partitions} partitions"
        ))
    })?;
    let mut records = Vec::with_capacity(mine.len());
    let iter = reader.get_row_iter(None).map_err(not_parquet)?;
    for (number, row) in iter.enumerate().skip(mine.start).take(mine.len()) {
        if holdout.is_some_and(|h| !h.keeps(number as u64)) {
            continue;
        }
        let at = format!("row {number}");
        let row = row.map_err(|e| Error::Dataset(format!("{path}: {at}: {e}")))?;
        let record = Record::parse(&row.to_json_value()).map_err(|e| Error::Dataset(format!("{path}: {at}: {e}")))?;
        records.push((at, record));
    }
    Ok(records)
}
