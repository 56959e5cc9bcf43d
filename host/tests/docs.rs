//! The docs list what the tree has: every built-in filter (a crate under
//! `plugins/`) is a row of the book's table of built-ins, linked to its
//! page under `docs/filters/`, and the README and the book say how many
//! there are.

use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The built-in filters: the directories of `plugins/` with a crate.
fn builtins() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root().join("plugins"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|dir| dir.join("Cargo.toml").is_file())
        .map(|dir| dir.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// A count as the docs write it in words.
fn in_words(n: usize) -> String {
    const ONES: [&str; 20] = [
        "zero",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "eleven",
        "twelve",
        "thirteen",
        "fourteen",
        "fifteen",
        "sixteen",
        "seventeen",
        "eighteen",
        "nineteen",
    ];
    const TENS: [&str; 10] = [
        "", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety",
    ];
    match n {
        0..20 => ONES[n].to_owned(),
        _ if n.is_multiple_of(10) => TENS[n / 10].to_owned(),
        _ => format!("{}-{}", TENS[n / 10], ONES[n % 10]),
    }
}

#[test]
fn every_builtin_filter_is_listed_and_linked_to_its_page() {
    let table = read("docs/book/builtin-filters.md");
    for name in builtins() {
        let row = format!("| [`{name}`](../filters/{name}.md) |");
        assert!(
            table.contains(&row),
            "docs/book/builtin-filters.md has no row {row}"
        );
        let page = root().join("docs/filters").join(format!("{name}.md"));
        assert!(page.is_file(), "{} is missing", page.display());
    }
    let rows = table.lines().filter(|l| l.starts_with("| [`")).count();
    assert_eq!(
        rows,
        builtins().len(),
        "a row for each built-in and no other"
    );
}

#[test]
fn the_readme_and_the_book_count_the_builtin_filters_right() {
    let count = in_words(builtins().len());
    let capitalised = format!("{}{}", count[..1].to_uppercase(), &count[1..]);
    for (path, says) in [
        (
            "README.md",
            format!("the {count}, with their hooks and grants"),
        ),
        (
            "docs/book/introduction.md",
            format!("{count} come built in"),
        ),
        (
            "docs/book/introduction.md",
            format!("the {count}, each with its page"),
        ),
        (
            "docs/book/builtin-filters.md",
            format!("{capitalised} filters come with shallot"),
        ),
        (
            "docs/book/writing-filters-rust.md",
            format!("`plugins/` has {count}"),
        ),
    ] {
        assert!(read(path).contains(&says), "{path} does not say \"{says}\"");
    }
}
