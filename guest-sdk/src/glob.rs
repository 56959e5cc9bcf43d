//! Name patterns, as filters' configurations write them for tools:
//! `delete_*`, `*_admin`, `read_*_file`, `*`.

/// Whether `name` matches `pattern`, where `*` matches any run of
/// characters (none included) and everything else matches itself.
pub fn matches(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn a_star_matches_any_run_and_the_rest_matches_itself() {
        for (pattern, name, expected) in [
            ("*", "anything", true),
            ("delete_*", "delete_user", true),
            ("delete_*", "undelete_user", false),
            ("*_admin", "be_admin", true),
            ("read_*_file", "read_big_file", true),
            ("read_*_file", "read_file", false),
            ("exact", "exact", true),
            ("exact", "exactly", false),
            ("a*a", "a", false),
        ] {
            assert_eq!(matches(pattern, name), expected, "{pattern} ~ {name}");
        }
    }
}
