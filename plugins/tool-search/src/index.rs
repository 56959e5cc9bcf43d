//! The two indexes over the tools (PEER-CASES L): BM25 over keywords
//! (names boosted, camelCase and snake_case split, CJK as bigrams) and a
//! regex over names and descriptions. Queries come from the model, so no
//! input may fail: a bad pattern falls back to a literal match.

use std::collections::{HashMap, HashSet};

use regex_lite::RegexBuilder;

/// A tool as the indexes see it.
pub struct Doc {
    pub name: String,
    pub description: String,
}

/// What a character is to the tokenizer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Word,
    Cjk,
    Other,
}

fn class(c: char) -> Class {
    let code = c as u32;
    let cjk = matches!(code,
        0x3040..=0x30FF       // hiragana, katakana
        | 0x3400..=0x4DBF     // CJK extension A
        | 0x4E00..=0x9FFF     // CJK unified ideographs
        | 0x1100..=0x11FF     // Hangul jamo
        | 0xAC00..=0xD7AF     // Hangul syllables
        | 0xF900..=0xFAFF     // CJK compatibility ideographs
        | 0xFF66..=0xFF9F     // half-width katakana
        | 0x20000..=0x2EBEF); // CJK extensions B-F
    if cjk {
        Class::Cjk
    } else if matches!(code, 0x3000..=0x303F | 0xFF00..=0xFF65 | 0xFFA0..=0xFFEF) {
        Class::Other
    } else if c.is_ascii_alphanumeric() || (!c.is_ascii() && c.is_alphanumeric()) {
        Class::Word
    } else {
        Class::Other
    }
}

/// Splits a word run at camelCase boundaries (`getWeather` → get, weather;
/// `HTTPServer` → http, server), lowercased.
fn split_camel(run: &[char], out: &mut Vec<String>) {
    let mut start = 0;
    for i in 1..run.len() {
        let (prev, here) = (run[i - 1], run[i]);
        let lower_to_upper = (prev.is_lowercase() || prev.is_numeric()) && here.is_uppercase();
        let acronym_end = prev.is_uppercase()
            && here.is_uppercase()
            && run.get(i + 1).is_some_and(|next| next.is_lowercase());
        if lower_to_upper || acronym_end {
            out.push(run[start..i].iter().collect::<String>().to_lowercase());
            start = i;
        }
    }
    out.push(run[start..].iter().collect::<String>().to_lowercase());
}

/// The tokens of `text`: word runs split and lowercased, CJK runs as
/// bigrams (a single character alone), everything else a boundary.
pub fn tokens(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let kind = class(chars[i]);
        let start = i;
        while i < chars.len() && class(chars[i]) == kind {
            i += 1;
        }
        let run = &chars[start..i];
        match kind {
            Class::Word => split_camel(run, &mut out),
            Class::Cjk if run.len() == 1 => out.push(run[0].to_string()),
            Class::Cjk => out.extend(run.windows(2).map(|pair| pair.iter().collect())),
            Class::Other => {}
        }
    }
    out
}

/// BM25's parameters.
pub struct Bm25 {
    pub k1: f64,
    pub b: f64,
    pub name_boost: usize,
}

/// The names best matching `query` by BM25, at most `max`, ties by name.
pub fn keyword(docs: &[Doc], query: &str, max: usize, params: &Bm25) -> Vec<String> {
    let bodies: Vec<Vec<String>> = docs
        .iter()
        .map(|doc| {
            let name = tokens(&doc.name);
            let mut body: Vec<String> = std::iter::repeat_n(name, params.name_boost)
                .flatten()
                .collect();
            body.extend(tokens(&doc.description));
            body
        })
        .collect();
    let n = bodies.len() as f64;
    let average = bodies.iter().map(Vec::len).sum::<usize>() as f64 / n.max(1.0);
    let mut seen = HashSet::new();
    let terms: Vec<String> = tokens(query)
        .into_iter()
        .filter(|t| seen.insert(t.clone()))
        .collect();
    let mut scored: Vec<(f64, &str)> = Vec::new();
    for (doc, body) in docs.iter().zip(&bodies) {
        let mut counts: HashMap<&str, f64> = HashMap::new();
        for token in body {
            *counts.entry(token.as_str()).or_default() += 1.0;
        }
        let length = body.len() as f64;
        let score: f64 = terms
            .iter()
            .filter_map(|term| {
                let tf = *counts.get(term.as_str())?;
                let df = bodies.iter().filter(|b| b.contains(term)).count() as f64;
                let idf = (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
                let norm = params.k1 * (1.0 - params.b + params.b * length / average.max(1.0));
                Some(idf * tf * (params.k1 + 1.0) / (tf + norm))
            })
            .sum();
        if score > 0.0 {
            scored.push((score, &doc.name));
        }
    }
    scored.sort_by(|a, b| b.0.total_cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    scored
        .into_iter()
        .take(max)
        .map(|(_, name)| name.to_owned())
        .collect()
}

/// The names whose name or description matches `query` as a regex (a
/// literal substring if it is not one), name hits first, ties by name.
pub fn regex(docs: &[Doc], query: &str, max: usize, case_sensitive: bool) -> Vec<String> {
    let matcher: Box<dyn Fn(&str) -> bool> = match RegexBuilder::new(query)
        .case_insensitive(!case_sensitive)
        .build()
    {
        Ok(regex) => Box::new(move |text| regex.is_match(text)),
        Err(_) if case_sensitive => {
            let literal = query.to_owned();
            Box::new(move |text| text.contains(&literal))
        }
        Err(_) => {
            let literal = query.to_lowercase();
            Box::new(move |text| text.to_lowercase().contains(&literal))
        }
    };
    let mut hits: Vec<(u8, &str)> = docs
        .iter()
        .filter_map(|doc| {
            if matcher(&doc.name) {
                Some((0, doc.name.as_str()))
            } else if matcher(&doc.description) {
                Some((1, doc.name.as_str()))
            } else {
                None
            }
        })
        .collect();
    hits.sort();
    hits.into_iter()
        .take(max)
        .map(|(_, name)| name.to_owned())
        .collect()
}
