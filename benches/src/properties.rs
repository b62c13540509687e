//! Java `.properties` files as YCSB reads them: `key=value` or `key: value`
//! (or `key value`), `#` and `!` comments, backslash line continuations.

use std::collections::BTreeMap;
use std::path::Path;

/// Properties in file order of last assignment; later ones win.
#[derive(Debug, Default, Clone)]
pub struct Properties {
    values: BTreeMap<String, String>,
}

impl Properties {
    pub fn parse(text: &str) -> Properties {
        let mut props = Properties::default();
        let mut pending = String::new();
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
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read workload file {}: {e}", path.display()))?;
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
}
