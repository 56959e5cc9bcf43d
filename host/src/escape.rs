//! Text from a guest (or a model, or a client) made safe for where it goes:
//! a single line a person or a log reader sees ([`printable`], uncut:
//! [`terminal_line`]), text shown at a terminal that keeps its line breaks
//! ([`terminal_text`]), and a JSON line ([`json_line`]).
//!
//! What is escaped is what could forge or hide text: control characters
//! (C0, DEL and C1, which holds the 8-bit CSI `U+009B` and the next-line
//! `U+0085`), the Unicode line and paragraph separators (`U+2028`,
//! `U+2029`: a reader that splits on Unicode line breaks would see a line
//! the filter made up), bidirectional overrides and isolates, and
//! invisible characters (zero-width spaces and joiners, the soft hyphen,
//! variation selectors, tag characters, Hangul fillers, the byte-order
//! mark).

use std::io;

use serde::Serialize;

/// The longest text from a guest that the host prints or logs.
pub(crate) const TEXT_CAP: usize = 2048;

/// Whether `c` must not reach a reader as it is: a control character, a
/// Unicode line break, or a format character that reorders or hides text.
pub(crate) fn unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{00ad}' | '\u{034f}' | '\u{061c}' | '\u{115f}' | '\u{1160}'
            | '\u{180b}'..='\u{180f}' | '\u{200b}'..='\u{200f}' | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{206f}' | '\u{3164}' | '\u{fe00}'..='\u{fe0f}' | '\u{feff}'
            | '\u{ffa0}' | '\u{fff9}'..='\u{fffb}' | '\u{e0000}'..='\u{e007f}')
}

/// Text made safe to print on one line: every [`unsafe_char`] escaped
/// (`\n`, `\t`, `\u{1b}`, `\u{2028}`), and cut to `cap` bytes with a note
/// of what was cut. The cap is on what is written, escapes included.
pub(crate) fn printable(text: &str, cap: usize) -> String {
    escaped(text, cap, false)
}

/// Text made safe to show at a terminal: every character that could forge
/// a line, move the cursor, reorder or hide text escaped as `\u{..}`, but
/// line breaks (`\n`) and tabs kept, and nothing cut. For what a filter or
/// a model says that a program shows a person (an approval question, an
/// error, a tool's output).
pub fn terminal_text(text: &str) -> String {
    escaped(text, usize::MAX, true)
}

/// As [`terminal_text`], but line breaks and tabs escaped too (`\n`,
/// `\t`): for a name from outside (a path, a key) that goes inside a line
/// of the host's own, where a break would start a line it did not write.
pub fn terminal_line(text: &str) -> String {
    escaped(text, usize::MAX, false)
}

fn escaped(text: &str, cap: usize, keep_lines: bool) -> String {
    let mut out = String::with_capacity(text.len().min(cap) + 16);
    for (at, c) in text.char_indices() {
        if out.len() >= cap {
            out.push_str(&format!("… ({} more bytes)", text.len() - at));
            break;
        }
        match c {
            '\n' | '\t' if keep_lines => out.push(c),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if unsafe_char(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out
}

/// `value` as one line of JSON (no trailing newline) in which every
/// character that could forge a line or a command inside a string (see
/// [`terminal_text`]) is written as a `\u` escape: the same JSON to a
/// parser, and nothing a line-splitting reader or a terminal takes for a
/// break or a command.
pub fn json_line(value: &impl Serialize) -> String {
    let mut line = Vec::new();
    let mut writer = serde_json::Serializer::with_formatter(&mut line, LineSafe);
    value
        .serialize(&mut writer)
        .expect("a JSON value serializes");
    String::from_utf8(line).expect("serde_json writes UTF-8")
}

/// serde_json's compact formatter, but escaping [`unsafe_char`]s that it
/// would write as they are.
struct LineSafe;

impl serde_json::ser::Formatter for LineSafe {
    fn write_string_fragment<W: ?Sized + io::Write>(
        &mut self,
        writer: &mut W,
        fragment: &str,
    ) -> io::Result<()> {
        let mut start = 0;
        for (at, c) in fragment.char_indices() {
            if unsafe_char(c) {
                writer.write_all(&fragment.as_bytes()[start..at])?;
                write!(writer, "\\u{:04x}", c as u32)?;
                start = at + c.len_utf8();
            }
        }
        writer.write_all(&fragment.as_bytes()[start..])
    }
}

#[cfg(test)]
mod tests {
    use super::{json_line, printable, terminal_text};

    #[test]
    fn printable_escapes_what_could_fool_a_terminal_and_caps_the_length() {
        assert_eq!(printable("a\u{1b}[31mb\0c", 100), "a\\u{1b}[31mb\\u{0}c");
        assert_eq!(printable("x\u{202e}y\nz", 100), "x\\u{202e}y\\nz");
        assert_eq!(printable("héllo wörld", 100), "héllo wörld");
        let long = "a".repeat(5000);
        let cut = printable(&long, 100);
        assert!(cut.starts_with(&"a".repeat(100)));
        assert!(cut.ends_with("… (4900 more bytes)"), "{cut}");
    }

    #[test]
    fn unicode_line_breaks_and_c1_controls_are_escaped_everywhere() {
        let forged = "ok\u{85}safeguard: approved\u{2028}x\u{2029}y\u{9b}2J\u{200b}z";
        let line = printable(forged, 1000);
        assert_eq!(
            line,
            "ok\\u{85}safeguard: approved\\u{2028}x\\u{2029}y\\u{9b}2J\\u{200b}z"
        );
        assert_eq!(
            terminal_text("one\ntwo\u{2028}three\u{1b}[2J"),
            "one\ntwo\\u{2028}three\\u{1b}[2J"
        );
        let json = json_line(&serde_json::json!({ "said": forged }));
        assert!(
            !json.chars().any(super::unsafe_char),
            "nothing unsafe is left raw: {json:?}"
        );
        let back: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(back["said"], forged, "the same JSON to a parser");
    }

    #[test]
    fn a_capped_line_is_capped_as_written_escapes_included() {
        let cut = printable(&"\u{1}".repeat(10_000), 100);
        assert!(cut.len() < 140, "{} bytes", cut.len());
    }
}
