//! Words of a prompt line and values on the screen, quoted the way
//! `redis-cli` quotes them (its `sdssplitargs` and `sdscatrepr`), so that a
//! value with spaces or binary bytes can be typed and read back exactly.
//!
//! - Words are separated by blanks. `"..."` takes the escapes `\n \r \t \b
//!   \a \\ \"` and `\xHH` (any byte); `'...'` takes only `\'`. A closing
//!   quote must be followed by a blank or the end of the line.
//! - A value is shown in double quotes, with printable ASCII as itself and
//!   every other byte escaped as above, so that pasting it back stores the
//!   same bytes.

/// Why a line could not be split (redis-cli says "Invalid argument(s)").
#[derive(Debug, PartialEq, Eq)]
pub struct Unbalanced;

impl std::fmt::Display for Unbalanced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Invalid argument(s): unbalanced quotes")
    }
}

/// The words of `line`, as bytes.
pub fn split(line: &str) -> Result<Vec<Vec<u8>>, Unbalanced> {
    // redis-cli reads a C string: a NUL ends the line.
    let bytes = line.as_bytes();
    let bytes = &bytes[..bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len())];
    let mut words = Vec::new();
    let mut i = 0;
    loop {
        while i < bytes.len() && is_space(bytes[i]) {
            i += 1;
        }
        if i == bytes.len() {
            return Ok(words);
        }
        let mut word = Vec::new();
        loop {
            match bytes.get(i) {
                None | Some(b' ' | b'\n' | b'\r' | b'\t') => break,
                // A closing quote ends the word.
                Some(b'"') => {
                    i = double_quoted(bytes, i + 1, &mut word)?;
                    break;
                }
                Some(b'\'') => {
                    i = single_quoted(bytes, i + 1, &mut word)?;
                    break;
                }
                Some(&c) => {
                    word.push(c);
                    i += 1;
                }
            }
        }
        words.push(word);
    }
}

/// Reads a `"..."` word from just after its opening quote; returns where
/// the word ends.
fn double_quoted(bytes: &[u8], mut i: usize, word: &mut Vec<u8>) -> Result<usize, Unbalanced> {
    loop {
        match bytes.get(i) {
            None => return Err(Unbalanced),
            Some(b'\\') => {
                let hex = bytes.get(i + 2..i + 4).and_then(hex_byte);
                match (bytes.get(i + 1), hex) {
                    (Some(b'x'), Some(b)) => {
                        word.push(b);
                        i += 4;
                        continue;
                    }
                    (Some(&c), _) => word.push(match c {
                        b'n' => b'\n',
                        b'r' => b'\r',
                        b't' => b'\t',
                        b'b' => 0x08,
                        b'a' => 0x07,
                        other => other,
                    }),
                    (None, _) => return Err(Unbalanced),
                }
                i += 2;
            }
            Some(b'"') => return closed(bytes, i + 1),
            Some(&c) => {
                word.push(c);
                i += 1;
            }
        }
    }
}

fn single_quoted(bytes: &[u8], mut i: usize, word: &mut Vec<u8>) -> Result<usize, Unbalanced> {
    loop {
        match bytes.get(i) {
            None => return Err(Unbalanced),
            Some(b'\\') if bytes.get(i + 1) == Some(&b'\'') => {
                word.push(b'\'');
                i += 2;
            }
            Some(b'\'') => return closed(bytes, i + 1),
            Some(&c) => {
                word.push(c);
                i += 1;
            }
        }
    }
}

/// A closing quote must end the word.
fn closed(bytes: &[u8], i: usize) -> Result<usize, Unbalanced> {
    match bytes.get(i) {
        None => Ok(i),
        Some(&c) if is_space(c) => Ok(i),
        Some(_) => Err(Unbalanced),
    }
}

/// C's `isspace`, which redis-cli skips between words with (a word itself
/// ends only at a space, tab, CR, LF or NUL).
fn is_space(c: u8) -> bool {
    matches!(c, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

fn hex_byte(two: &[u8]) -> Option<u8> {
    let hex = |c: u8| char::from(c).to_digit(16);
    match two {
        [hi, lo] => Some((hex(*hi)? * 16 + hex(*lo)?) as u8),
        _ => None,
    }
}

/// `bytes` in double quotes, escaped so that [`split`] reads it back.
pub fn quote(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() + 2);
    out.push('"');
    for &b in bytes {
        match b {
            b'\\' => out.push_str("\\\\"),
            b'"' => out.push_str("\\\""),
            b'\n' => out.push_str("\\n"),
            b'\r' => out.push_str("\\r"),
            b'\t' => out.push_str("\\t"),
            0x07 => out.push_str("\\a"),
            0x08 => out.push_str("\\b"),
            b' '..=b'~' => out.push(char::from(b)),
            other => out.push_str(&format!("\\x{other:02x}")),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(line: &str) -> Vec<Vec<u8>> {
        split(line).expect("balanced")
    }

    #[test]
    fn blanks_separate_words_and_quotes_keep_them_together() {
        assert_eq!(words("  put  k   v "), [&b"put"[..], b"k", b"v"]);
        assert_eq!(
            words(r#"put "hello world" 'x  y'"#),
            [&b"put"[..], b"hello world", b"x  y"]
        );
    }

    #[test]
    fn double_quotes_take_redis_cli_escapes() {
        assert_eq!(
            words(r#"put k "a\"b\\c\n\t\x00\xff\x4A""#)[2],
            b"a\"b\\c\n\t\x00\xffJ"
        );
        // Not a hex escape: the x stays (a sign is not a digit).
        assert_eq!(words(r#""\xzz""#)[0], b"xzz");
        assert_eq!(words(r#""\x+f""#)[0], b"x+f");
        assert_eq!(words(r#"'don\'t \n'"#)[0], b"don't \\n");
    }

    #[test]
    fn a_nul_ends_the_line_and_a_closing_quote_ends_the_word() {
        assert_eq!(words("get a\0b c"), [&b"get"[..], b"a"]);
        assert_eq!(words("\0"), Vec::<Vec<u8>>::new());
        // A vertical tab after a closing quote separates, and is not kept.
        assert_eq!(words("\"a\"\x0bb"), [&b"a"[..], b"b"]);
        assert_eq!(words("ab\"c d\""), [&b"abc d"[..]]);
    }

    #[test]
    fn unbalanced_or_glued_quotes_are_refused() {
        for line in [r#"get "open"#, "get 'open", r#"get "a"b"#, r#"get "a\"#] {
            assert_eq!(split(line), Err(Unbalanced), "{line}");
        }
    }

    #[test]
    fn every_byte_string_quotes_and_splits_back_to_itself() {
        let all: Vec<u8> = (0..=255).collect();
        for value in [&all[..], b"", b"plain", b"with space", b"\"'\\"] {
            assert_eq!(words(&quote(value)), [value]);
        }
        assert_eq!(quote(b"a b\n\x01\xff"), r#""a b\n\x01\xff""#);
    }
}
