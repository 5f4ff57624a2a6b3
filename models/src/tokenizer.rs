//! A Hugging Face tokenizer (`tokenizer.json`, byte-level BPE at least) through the
//! `tokenizers` crate: text to token ids for `p2ptrain tokenize` and data, ids back to text
//! for `sample`, and the bytes of text each id stands for, so that a model's loss reads as
//! bits per byte whatever its vocabulary.

use std::path::Path;
use std::sync::Arc;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::Tokenizer;

use crate::{Error, Result};

/// Largest `tokenizer.json` read (Llama 3's, 128k tokens and their merges, is ~9 MB).
const MAX_TOKENIZER_BYTES: u64 = 64 << 20;

/// A loaded tokenizer and the bytes each of its ids stands for.
pub struct TextTokenizer {
    inner: Tokenizer,
    bytes_per_token: Arc<Vec<u32>>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab", &self.vocab_size())
            .finish()
    }
}

impl TextTokenizer {
    /// Reads `path`, a Hugging Face `tokenizer.json`.
    pub fn load(path: &Path) -> Result<TextTokenizer> {
        let io = |source| Error::Io {
            path: path.to_owned(),
            source,
        };
        let len = std::fs::metadata(path).map_err(io)?.len();
        if len > MAX_TOKENIZER_BYTES {
            return Err(Error::Format {
                path: path.to_owned(),
                msg: format!("{len} bytes, past the {MAX_TOKENIZER_BYTES} a tokenizer may have"),
            });
        }
        let bytes = std::fs::read(path).map_err(io)?;
        let inner = Tokenizer::from_bytes(&bytes).map_err(|e| Error::Format {
            path: path.to_owned(),
            msg: format!("not a tokenizer.json the tokenizers library reads: {e}"),
        })?;
        let bytes_per_token = Arc::new(bytes_per_token(&inner));
        Ok(TextTokenizer {
            inner,
            bytes_per_token,
        })
    }

    /// Ids the tokenizer has (added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// One past the largest id the tokenizer can produce (an added token's id may lie past
    /// the count of ids): the model's vocabulary must be at least this, and a token file's
    /// ids must fit their width.
    pub fn id_bound(&self) -> usize {
        self.inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0)
    }

    /// Refuses this tokenizer (read from `path`) for a model of `vocab` ids when it can
    /// produce an id past them: it is another model's tokenizer, whatever ids a given text
    /// happens to give.
    pub fn check_fits(&self, vocab: usize, path: &Path) -> Result<()> {
        let ids = self.id_bound();
        if ids > vocab {
            return Err(Error::Spec(format!(
                "{} has {ids} ids, past the model's vocabulary of {vocab}: another model's \
                 tokenizer",
                path.display()
            )));
        }
        Ok(())
    }

    /// The ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Spec(format!("tokenizing: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text `ids` stand for (special tokens kept).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Spec(format!("decoding token ids: {e}")))
    }

    /// Bytes of text each id stands for (0 for special tokens and unknown ids).
    pub fn bytes_per_token(&self) -> Arc<Vec<u32>> {
        Arc::clone(&self.bytes_per_token)
    }
}

/// Bytes of text each id of `tokenizer` stands for. A byte-level tokenizer's token strings
/// spell one byte per character (GPT-2's byte-to-character table); otherwise a token
/// `<0xNN>` is one byte (SentencePiece's byte fallback), `▁` one (a space), and any other
/// character its UTF-8 length. Special (added) tokens stand for no text.
fn bytes_per_token(tokenizer: &Tokenizer) -> Vec<u32> {
    let byte_level = tokenizer.get_decoder().is_some_and(|d| match d {
        DecoderWrapper::ByteLevel(_) => true,
        DecoderWrapper::Sequence(seq) => seq
            .get_decoders()
            .iter()
            .any(|d| matches!(d, DecoderWrapper::ByteLevel(_))),
        _ => false,
    });
    let special: std::collections::HashSet<u32> = tokenizer
        .get_added_tokens_decoder()
        .iter()
        .filter(|(_, t)| t.special)
        .map(|(id, _)| *id)
        .collect();
    (0..tokenizer.get_vocab_size(true) as u32)
        .map(|id| {
            if special.contains(&id) {
                return 0;
            }
            let Some(token) = tokenizer.id_to_token(id) else {
                return 0;
            };
            if byte_level {
                token.chars().count() as u32
            } else if token.len() == 6 && token.starts_with("<0x") && token.ends_with('>') {
                1
            } else {
                token
                    .chars()
                    .map(|c| {
                        if c == '\u{2581}' {
                            1
                        } else {
                            c.len_utf8() as u32
                        }
                    })
                    .sum()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn fixture() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/hf-llama-tiny")
    }

    /// The fixture's tokenizer gives the ids and bytes per token that the Python `tokenizers`
    /// gave (`expected.json`), and decodes them back to the text.
    #[test]
    fn the_fixture_tokenizer_gives_pythons_ids_and_bytes() {
        let tok = TextTokenizer::load(&fixture().join("tokenizer.json")).expect("tokenizer");
        assert_eq!((tok.vocab_size(), tok.id_bound()), (384, 384));
        let expected: Value = serde_json::from_str(
            &std::fs::read_to_string(fixture().join("expected.json")).expect("expected"),
        )
        .expect("json");
        let check = &expected["tokenizer_check"];
        let text = check["text"].as_str().expect("text");
        let want: Vec<u32> = check["ids"]
            .as_array()
            .expect("ids")
            .iter()
            .map(|v| v.as_u64().expect("id") as u32)
            .collect();
        let ids = tok.encode(text).expect("encode");
        assert_eq!(ids, want);
        let table = tok.bytes_per_token();
        let bytes: Vec<u64> = ids
            .iter()
            .map(|&id| u64::from(table[id as usize]))
            .collect();
        let want_bytes: Vec<u64> = check["token_bytes"]
            .as_array()
            .expect("bytes")
            .iter()
            .map(|v| v.as_u64().expect("n"))
            .collect();
        assert_eq!(bytes, want_bytes);
        assert_eq!(bytes.iter().sum::<u64>(), text.len() as u64);
        assert_eq!(tok.decode(&ids).expect("decode"), text);
    }

    #[test]
    fn what_is_not_a_tokenizer_is_refused_with_the_file_named() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, "{\"model\": 3}").expect("write");
        let e = TextTokenizer::load(&path).expect_err("bad");
        assert!(e.to_string().contains("tokenizer.json"), "{e}");
        assert!(TextTokenizer::load(&dir.path().join("missing.json")).is_err());
    }
}
