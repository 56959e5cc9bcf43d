/// One streamed token as the caller's sink receives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Token<'a> {
    /// Its text.
    pub text: &'a str,
    /// Metadata, a JSON object as text.
    pub meta: Option<&'a str>,
}

/// Tokens packed for cheap hand-over between token transforms: all texts
/// back to back, the end offset of each, and the metadata of the few tokens
/// that carry any (sorted by index).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenBatch {
    /// Every token's text, back to back.
    pub text: String,
    /// The byte offset in `text` where each token ends.
    pub ends: Vec<u32>,
    /// (token index, metadata JSON) for the tokens that carry metadata.
    pub metas: Vec<(u32, String)>,
}

impl TokenBatch {
    /// Appends one token.
    pub fn push(&mut self, text: &str, meta: Option<&str>) {
        if let Some(meta) = meta {
            self.metas.push((self.ends.len() as u32, meta.to_owned()));
        }
        self.text.push_str(text);
        self.ends.push(self.text.len() as u32);
    }

    /// Appends every token of `other`.
    pub fn append(&mut self, other: TokenBatch) {
        if self.ends.is_empty() {
            *self = other;
            return;
        }
        let offset = self.text.len() as u32;
        let base = self.ends.len() as u32;
        self.text.push_str(&other.text);
        self.ends.extend(other.ends.iter().map(|end| end + offset));
        self.metas
            .extend(other.metas.into_iter().map(|(i, m)| (i + base, m)));
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are no tokens.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The tokens, in order.
    pub fn iter(&self) -> impl Iterator<Item = Token<'_>> {
        let mut metas = self.metas.iter().peekable();
        let mut start = 0usize;
        self.ends.iter().enumerate().map(move |(index, &end)| {
            let end = end as usize;
            let text = &self.text[start..end];
            start = end;
            let meta = match metas.peek() {
                Some((i, _)) if *i as usize == index => metas.next().map(|(_, m)| m.as_str()),
                _ => None,
            };
            Token { text, meta }
        })
    }

    /// Checks what a guest handed back: ends ascending, on char boundaries
    /// and within the text; metas sorted and in range.
    pub fn validate(&self) -> Result<(), String> {
        let mut start = 0usize;
        for &end in &self.ends {
            let end = end as usize;
            if end < start || end > self.text.len() || !self.text.is_char_boundary(end) {
                return Err(format!(
                    "token end {end} is out of order or not on a character boundary"
                ));
            }
            start = end;
        }
        if start != self.text.len() {
            return Err("token text extends past the last token end".to_owned());
        }
        let mut previous = None;
        for (index, _) in &self.metas {
            if *index as usize >= self.ends.len() || previous.is_some_and(|p| p >= *index) {
                return Err(format!(
                    "token meta index {index} is out of range or out of order"
                ));
            }
            previous = Some(*index);
        }
        Ok(())
    }
}

impl<'a> FromIterator<Token<'a>> for TokenBatch {
    fn from_iter<I: IntoIterator<Item = Token<'a>>>(iter: I) -> Self {
        let mut batch = TokenBatch::default();
        for token in iter {
            batch.push(token.text, token.meta);
        }
        batch
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(tokens: &[(&str, Option<&str>)]) -> TokenBatch {
        tokens
            .iter()
            .map(|&(text, meta)| Token { text, meta })
            .collect()
    }

    #[test]
    fn tokens_come_back_out_as_they_went_in() {
        let b = batch(&[("he", None), ("llo", Some(r#"{"k":1}"#)), ("", None)]);
        let out: Vec<Token<'_>> = b.iter().collect();
        assert_eq!(
            out,
            [
                Token {
                    text: "he",
                    meta: None
                },
                Token {
                    text: "llo",
                    meta: Some(r#"{"k":1}"#)
                },
                Token {
                    text: "",
                    meta: None
                }
            ]
        );
        assert!(b.validate().is_ok());
    }

    #[test]
    fn appending_shifts_offsets_and_meta_indices() {
        let mut a = batch(&[("a", None)]);
        a.append(batch(&[("bc", Some("{}")), ("d", None)]));
        assert_eq!(a, batch(&[("a", None), ("bc", Some("{}")), ("d", None)]));
    }

    #[test]
    fn a_malformed_batch_is_refused() {
        let out_of_order = TokenBatch {
            text: "abc".into(),
            ends: vec![2, 1, 3],
            metas: vec![],
        };
        assert!(out_of_order.validate().is_err());
        let mid_char = TokenBatch {
            text: "é".into(),
            ends: vec![1, 2],
            metas: vec![],
        };
        assert!(mid_char.validate().is_err());
        let short = TokenBatch {
            text: "abc".into(),
            ends: vec![2],
            metas: vec![],
        };
        assert!(short.validate().is_err());
        let stray_meta = TokenBatch {
            text: "a".into(),
            ends: vec![1],
            metas: vec![(1, "{}".into())],
        };
        assert!(stray_meta.validate().is_err());
    }
}
