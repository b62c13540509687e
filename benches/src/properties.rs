//! Java `.properties` files as YCSB reads them: `key=value` or `key: value`
//! (or `key value`), `#` and `!` comments, backslash line continuations,
//! lines ended by `\n`, `\r\n` or `\r`, and text in UTF-8 or, as Java
//! reads it, ISO-8859-1.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

/// Largest workload file read: far beyond any real one, and a bound for a
/// path that is no file of properties (`/dev/zero`).
const MAX_FILE: u64 = 1 << 20;

/// Properties in file order of last assignment; later ones win.
#[derive(Debug, Default, Clone)]
pub struct Properties {
    values: BTreeMap<String, String>,
}

impl Properties {
    pub fn parse(text: &str) -> Properties {
        let mut props = Properties::default();
        let mut pending = String::new();
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let text = text.replace("\r\n", "\n").replace('\r', "\n");
        for raw in text.lines() {
            let line = raw.trim_start();
            if pending.is_empty()
                && (line.is_empty() || line.starts_with('#') || line.starts_with('!'))
            {
                continue;
            }
            // An odd number of trailing backslashes continues the line.
            let trailing = line.chars().rev().take_while(|&c| c == '\\').count();
            if trailing % 2 == 1 {
                pending.push_str(&line[..line.len() - 1]);
                continue;
            }
            pending.push_str(line);
            let logical = std::mem::take(&mut pending);
            props.set_line(&logical);
        }
        if !pending.is_empty() {
            props.set_line(&pending);
        }
        props
    }

    pub fn load(path: &Path) -> Result<Properties, String> {
        let cannot =
            |e: std::io::Error| format!("cannot read workload file {}: {e}", path.display());
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_FILE + 1).read_to_end(&mut bytes))
            .map_err(cannot)?;
        if bytes.len() as u64 > MAX_FILE {
            return Err(format!(
                "workload file {}: larger than {} KiB, not a file of properties",
                path.display(),
                MAX_FILE >> 10
            ));
        }
        let text = match String::from_utf8(bytes) {
            Ok(text) => text,
            // Java's Properties.load reads ISO-8859-1: each byte a char.
            Err(e) => e.into_bytes().iter().map(|&b| char::from(b)).collect(),
        };
        Ok(Properties::parse(&text))
    }

    fn set_line(&mut self, line: &str) {
        let line = line.trim();
        let split = line.find(['=', ':', ' ', '\t']).unwrap_or(line.len());
        let key = line[..split].trim();
        let mut rest = line[split..].trim_start();
        if rest.starts_with('=') || rest.starts_with(':') {
            rest = rest[1..].trim_start();
        }
        if !key.is_empty() {
            self.values.insert(key.to_string(), rest.to_string());
        }
    }

    /// Applies a `-p key=value` override.
    pub fn set_override(&mut self, assignment: &str) -> Result<(), String> {
        let (k, v) = assignment
            .split_once('=')
            .ok_or_else(|| format!("-p {assignment}: expected key=value"))?;
        if k.trim().is_empty() {
            return Err(format!("-p {assignment}: empty key"));
        }
        self.values
            .insert(k.trim().to_string(), v.trim().to_string());
        Ok(())
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str)
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.values.keys().map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_java_properties() {
        let p = Properties::parse(
            "# comment\n! also a comment\nrecordcount=1000\n  operationcount : 2000\nworkload site.ycsb.workloads.CoreWorkload\n\
             readproportion=0.5\\\n0\nempty=\nrecordcount=3000\n",
        );
        assert_eq!(p.get("recordcount"), Some("3000"));
        assert_eq!(p.get("operationcount"), Some("2000"));
        assert_eq!(p.get("workload"), Some("site.ycsb.workloads.CoreWorkload"));
        assert_eq!(p.get("readproportion"), Some("0.50"));
        assert_eq!(p.get("empty"), Some(""));
        assert_eq!(p.get("# comment"), None);
    }

    #[test]
    fn overrides_replace_file_values() {
        let mut p = Properties::parse("threadcount=1\n");
        p.set_override("threadcount=4").unwrap();
        p.set_override("new = x").unwrap();
        assert_eq!(p.get("threadcount"), Some("4"));
        assert_eq!(p.get("new"), Some("x"));
        assert!(p.set_override("novalue").is_err());
        assert!(p.set_override("=1").is_err());
    }

    #[test]
    fn any_line_ending_a_byte_order_mark_and_latin_1_read_as_java_reads_them() {
        let p = Properties::parse("\u{feff}recordcount=1\roperationcount=2\r\nfieldcount=\\\r 3\n");
        assert_eq!(p.get("recordcount"), Some("1"));
        assert_eq!(p.get("operationcount"), Some("2"));
        assert_eq!(p.get("fieldcount"), Some("3"));
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("latin1");
        std::fs::write(&path, b"# caf\xe9\nrecordcount=7\n").expect("write");
        assert_eq!(
            Properties::load(&path).expect("load").get("recordcount"),
            Some("7")
        );
        let err = Properties::load(Path::new("/dev/zero")).expect_err("/dev/zero");
        assert!(err.contains("not a file of properties"), "{err}");
    }
}
