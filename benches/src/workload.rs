//! A YCSB core workload: its properties, validated, and the records it
//! reads and writes (fieldcount fields of fieldlength bytes, stored as one
//! value: each field a 4-byte length and its bytes).

use std::time::Duration;

use crate::generator::{
    Hotspot, InsertOrder, KeyChooser, Rng, ScrambledZipfian, Zipfian, ZIPFIAN_CONSTANT,
};
use crate::properties::Properties;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Distribution {
    Uniform,
    Zipfian,
    Latest,
    Hotspot,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FieldLength {
    Constant,
    Uniform,
    Zipfian,
}

#[derive(Debug, Clone)]
pub struct Workload {
    pub recordcount: u64,
    pub operationcount: u64,
    pub fieldcount: u64,
    pub fieldlength: u64,
    pub fieldlengthdistribution: FieldLength,
    pub readproportion: f64,
    pub updateproportion: f64,
    pub insertproportion: f64,
    pub readmodifywriteproportion: f64,
    pub requestdistribution: Distribution,
    pub zipfianconstant: f64,
    pub hotspotdatafraction: f64,
    pub hotspotopnfraction: f64,
    pub insertorder: InsertOrder,
    pub insertstart: u64,
    pub insertcount: u64,
    pub writeallfields: bool,
    pub maxexecutiontime: Option<Duration>,
    pub threadcount: usize,
    /// Reads issued together, as one multi-key read (onekv's `get_many`,
    /// Redis's MGET, one LMDB read transaction); 1: one at a time.
    pub batchsize: usize,
    /// Target operations per second over all threads (None: as fast as possible).
    pub target: Option<f64>,
}

/// Keys this driver reads; anything else in a workload file is reported.
const KNOWN: &[&str] = &[
    "recordcount",
    "operationcount",
    "fieldcount",
    "fieldlength",
    "fieldlengthdistribution",
    "readproportion",
    "updateproportion",
    "insertproportion",
    "readmodifywriteproportion",
    "scanproportion",
    "requestdistribution",
    "zipfianconstant",
    "hotspotdatafraction",
    "hotspotopnfraction",
    "insertorder",
    "insertstart",
    "insertcount",
    "readallfields",
    "writeallfields",
    "maxexecutiontime",
    "threadcount",
    "batchsize",
    "target",
    // Names the Java workload class; this driver is that workload.
    "workload",
];

/// Largest `batchsize`.
const MAX_BATCH: usize = 4096;
/// Largest record (fieldcount fields of fieldlength bytes): each is built
/// whole in memory before it is written.
const MAX_RECORD: u64 = 1 << 30;
/// The Java workload classes this driver is (YCSB's, before and after its
/// move to site.ycsb).
const CORE_WORKLOAD: &[&str] = &[
    "site.ycsb.workloads.CoreWorkload",
    "com.yahoo.ycsb.workloads.CoreWorkload",
];
/// Most worker threads a run starts: each holds a connection of its own
/// (a server admits at most 4095 clients), and far more fail to start.
pub const MAX_THREADS: usize = 1024;

struct Reader<'a>(&'a Properties);

impl Reader<'_> {
    fn count(&self, key: &str, default: u64) -> Result<u64, String> {
        match self.0.get(key) {
            None => Ok(default),
            Some(v) => v
                .parse::<u64>()
                .map_err(|_| format!("{key}: '{v}' is not a non-negative whole number")),
        }
    }

    fn fraction(&self, key: &str, default: f64) -> Result<f64, String> {
        let v = match self.0.get(key) {
            None => return Ok(default),
            Some(v) => v,
        };
        let f: f64 = v
            .parse()
            .map_err(|_| format!("{key}: '{v}' is not a number"))?;
        if !(0.0..=1.0).contains(&f) {
            return Err(format!("{key}: {f} is outside 0..1"));
        }
        Ok(f)
    }

    fn flag(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.0.get(key) {
            None => Ok(default),
            // As Java's Boolean.parseBoolean, whatever the case.
            Some(v) if v.eq_ignore_ascii_case("true") => Ok(true),
            Some(v) if v.eq_ignore_ascii_case("false") => Ok(false),
            Some(v) => Err(format!("{key}: '{v}' is not true or false")),
        }
    }

    fn field_length_distribution(&self) -> Result<FieldLength, String> {
        match self.0.get("fieldlengthdistribution").unwrap_or("constant") {
            "constant" => Ok(FieldLength::Constant),
            "uniform" => Ok(FieldLength::Uniform),
            "zipfian" => Ok(FieldLength::Zipfian),
            other => Err(format!(
                "fieldlengthdistribution: '{other}' is not constant, uniform or zipfian"
            )),
        }
    }

    fn request_distribution(&self) -> Result<Distribution, String> {
        match self.0.get("requestdistribution").unwrap_or("uniform") {
            "uniform" => Ok(Distribution::Uniform),
            "zipfian" => Ok(Distribution::Zipfian),
            "latest" => Ok(Distribution::Latest),
            "hotspot" => Ok(Distribution::Hotspot),
            other => Err(format!(
                "requestdistribution: '{other}' is not uniform, zipfian, latest or hotspot"
            )),
        }
    }

    fn zipfian_constant(&self) -> Result<f64, String> {
        let Some(v) = self.0.get("zipfianconstant") else {
            return Ok(ZIPFIAN_CONSTANT);
        };
        let t: f64 = v
            .parse()
            .map_err(|_| format!("zipfianconstant: '{v}' is not a number"))?;
        if !(t > 0.0 && t < 1.0) {
            return Err(format!(
                "zipfianconstant: {t} must be between 0 and 1 (exclusive)"
            ));
        }
        Ok(t)
    }

    fn insert_order(&self) -> Result<InsertOrder, String> {
        match self.0.get("insertorder").unwrap_or("hashed") {
            "hashed" => Ok(InsertOrder::Hashed),
            "ordered" => Ok(InsertOrder::Ordered),
            other => Err(format!("insertorder: '{other}' is not hashed or ordered")),
        }
    }

    /// Operations per second; None: as fast as possible (0 or unset).
    fn target(&self) -> Result<Option<f64>, String> {
        let Some(v) = self.0.get("target") else {
            return Ok(None);
        };
        let t: f64 = v
            .parse()
            .map_err(|_| format!("target: '{v}' is not a number"))?;
        if t < 0.0 || !t.is_finite() {
            return Err(format!("target: {t} must be zero or positive"));
        }
        Ok((t > 0.0).then_some(t))
    }
}

impl Workload {
    /// Builds the workload; the second value lists warnings (unknown keys).
    pub fn from_properties(p: &Properties) -> Result<(Workload, Vec<String>), String> {
        let r = Reader(p);
        let warnings = p
            .keys()
            .filter(|k| !KNOWN.contains(k))
            .map(|k| format!("ignoring unknown workload property '{k}'"))
            .collect();
        let scan = r.fraction("scanproportion", 0.0)?;
        if scan > 0.0 {
            return Err(format!(
                "scanproportion: {scan} > 0, but onekv's index is a hash table and cannot serve \
                 range scans (YCSB workload E); set scanproportion=0"
            ));
        }
        if let Some(class) = p.get("workload").filter(|c| !CORE_WORKLOAD.contains(c)) {
            return Err(format!(
                "workload: '{class}' is not YCSB's CoreWorkload, the only workload this driver runs"
            ));
        }
        let recordcount = r.count("recordcount", 0)?;
        let insertstart = r.count("insertstart", 0)?;
        let insertcount = match p.get("insertcount") {
            None => recordcount.checked_sub(insertstart).ok_or_else(|| {
                format!("insertstart: {insertstart} is beyond recordcount {recordcount}")
            })?,
            // As YCSB: the records a load of this part inserts lie within
            // recordcount, which the run's keys are drawn from.
            Some(_) => {
                let count = r.count("insertcount", 0)?;
                match insertstart.checked_add(count) {
                    Some(end) if end <= recordcount => count,
                    _ => {
                        return Err(format!(
                            "insertstart + insertcount = {insertstart} + {count}: must not \
                             exceed recordcount {recordcount}"
                        ))
                    }
                }
            }
        };
        // A record is one block, fetched whole by one READ, so reading one
        // field costs the same as reading all: the flag is only validated.
        r.flag("readallfields", true)?;
        let w = Workload {
            recordcount,
            operationcount: r.count("operationcount", 0)?,
            fieldcount: r.count("fieldcount", 10)?,
            fieldlength: r.count("fieldlength", 100)?,
            fieldlengthdistribution: r.field_length_distribution()?,
            readproportion: r.fraction("readproportion", 0.95)?,
            updateproportion: r.fraction("updateproportion", 0.05)?,
            insertproportion: r.fraction("insertproportion", 0.0)?,
            readmodifywriteproportion: r.fraction("readmodifywriteproportion", 0.0)?,
            requestdistribution: r.request_distribution()?,
            zipfianconstant: r.zipfian_constant()?,
            hotspotdatafraction: r.fraction("hotspotdatafraction", 0.2)?,
            hotspotopnfraction: r.fraction("hotspotopnfraction", 0.8)?,
            insertorder: r.insert_order()?,
            insertstart,
            insertcount,
            writeallfields: r.flag("writeallfields", false)?,
            maxexecutiontime: match r.count("maxexecutiontime", 0)? {
                0 => None,
                s => Some(Duration::from_secs(s)),
            },
            threadcount: r.count("threadcount", 1)? as usize,
            batchsize: r.count("batchsize", 1)? as usize,
            target: r.target()?,
        };
        w.check(scan).map_err(|e| match e.contains("must be 1") {
            true => with_default_mix(e, p),
            false => e,
        })?;
        Ok((w, warnings))
    }

    /// Refuses a workload whose properties do not fit together.
    fn check(&self, scan: f64) -> Result<(), String> {
        let sum = self.readproportion
            + self.updateproportion
            + self.insertproportion
            + self.readmodifywriteproportion
            + scan;
        if (sum - 1.0).abs() > 1e-6 {
            return Err(format!(
                "readproportion + updateproportion + insertproportion + readmodifywriteproportion \
                 + scanproportion = {sum}, must be 1"
            ));
        }
        if self.fieldcount == 0 {
            return Err("fieldcount: must be at least 1".into());
        }
        if self.fieldlength == 0 {
            return Err("fieldlength: must be at least 1".into());
        }
        let record = (self.fieldlength + 4).checked_mul(self.fieldcount);
        if record.is_none_or(|bytes| bytes > MAX_RECORD) {
            return Err(format!(
                "fieldcount x fieldlength = {} x {}: a record may hold at most {} MiB",
                self.fieldcount,
                self.fieldlength,
                MAX_RECORD >> 20
            ));
        }
        if !(1..=MAX_THREADS).contains(&self.threadcount) {
            return Err(format!("threadcount: must be from 1 to {MAX_THREADS}"));
        }
        if !(1..=MAX_BATCH).contains(&self.batchsize) {
            return Err(format!("batchsize: must be from 1 to {MAX_BATCH}"));
        }
        if self.run_operations() > 0
            && self.insertcount == 0
            && self.readproportion + self.updateproportion + self.readmodifywriteproportion > 0.0
        {
            return Err(format!(
                "the load inserts no records (recordcount {}, insertcount {}), but the run reads \
                 or updates them: load at least 1",
                self.recordcount, self.insertcount
            ));
        }
        Ok(())
    }

    /// Operations the run phase does: operationcount, or, when that is 0
    /// and maxexecutiontime is set, as many as fit in it (as YCSB runs).
    pub fn run_operations(&self) -> u64 {
        match (self.operationcount, self.maxexecutiontime) {
            (0, Some(_)) => u64::MAX,
            (count, _) => count,
        }
    }

    /// The run phase's operations, said: a count, or for how long.
    pub fn describe_run(&self) -> String {
        match (self.run_operations(), self.maxexecutiontime) {
            (u64::MAX, Some(t)) => format!("operations for {} s", t.as_secs()),
            (count, _) => format!("{count} operations"),
        }
    }

    /// Records the run phase inserts at most: for a run bounded by its
    /// time alone, at its target rate, or at `FAST` operations per second
    /// (beyond what one host's clients reach).
    pub fn run_inserts(&self) -> u64 {
        const FAST: f64 = 2e6;
        let operations = match (self.run_operations(), self.maxexecutiontime) {
            (u64::MAX, Some(t)) => self.target.unwrap_or(FAST) * t.as_secs_f64(),
            (count, _) => count as f64,
        };
        // A float-to-integer cast saturates.
        (operations * self.insertproportion) as u64
    }

    /// The workload of a load done before a run, in the same command:
    /// maxexecutiontime bounds the run (a run on part of the records would
    /// read missing keys).
    pub fn for_load_before_run(&self) -> Workload {
        Workload {
            maxexecutiontime: None,
            ..self.clone()
        }
    }

    /// The run phase's key chooser (YCSB's CoreWorkload.init).
    pub fn key_chooser(&self) -> KeyChooser {
        let lower = self.insertstart;
        let upper = self.insertstart + self.insertcount.max(1) - 1;
        let loaded_end = self.insertstart + self.insertcount;
        match self.requestdistribution {
            Distribution::Uniform => KeyChooser::Uniform { lower, upper },
            Distribution::Zipfian => {
                // A float-to-integer cast saturates.
                let expected_new =
                    (self.operationcount as f64 * self.insertproportion * 2.0) as u64;
                KeyChooser::Zipfian(ScrambledZipfian::new(
                    lower,
                    loaded_end.saturating_add(expected_new),
                    self.zipfianconstant,
                ))
            }
            Distribution::Latest => {
                let span = self.insertcount.max(2);
                KeyChooser::Latest {
                    lower,
                    distance: Zipfian::new(0, span - 1, self.zipfianconstant),
                }
            }
            Distribution::Hotspot => KeyChooser::Hotspot(Hotspot::new(
                lower,
                upper,
                self.hotspotdatafraction,
                self.hotspotopnfraction,
            )),
        }
    }

    pub fn field_lengths(&self) -> FieldLengths {
        FieldLengths {
            kind: self.fieldlengthdistribution,
            max: self.fieldlength,
            zipf: Zipfian::new(1, self.fieldlength, ZIPFIAN_CONSTANT),
        }
    }
}

/// `error` (proportions that do not sum to 1), saying which of the mix's
/// defaults (YCSB's: reads 0.95, updates 0.05) it counted.
fn with_default_mix(error: String, p: &Properties) -> String {
    let defaults: Vec<&str> = [
        ("readproportion", "readproportion=0.95"),
        ("updateproportion", "updateproportion=0.05"),
    ]
    .into_iter()
    .filter(|(key, _)| p.get(key).is_none())
    .map(|(_, default)| default)
    .collect();
    match defaults.is_empty() {
        true => error,
        false => format!("{error} (counting the defaults {})", defaults.join(", ")),
    }
}

/// Draws field lengths as YCSB does.
#[derive(Clone)]
pub struct FieldLengths {
    kind: FieldLength,
    max: u64,
    zipf: Zipfian,
}

impl FieldLengths {
    pub fn next(&mut self, rng: &mut Rng) -> usize {
        (match self.kind {
            FieldLength::Constant => self.max,
            FieldLength::Uniform => 1 + rng.below(self.max),
            FieldLength::Zipfian => self.zipf.next(rng),
        }) as usize
    }
}

/// Appends one field of `len` pseudo-random printable bytes.
fn push_field(out: &mut Vec<u8>, len: usize, rng: &mut Rng) {
    out.extend_from_slice(&(len as u32).to_le_bytes());
    let mut left = len;
    while left > 0 {
        let word = rng.next_u64().to_le_bytes();
        for &b in word.iter().take(left) {
            out.push(b' ' + b % 95);
        }
        left = left.saturating_sub(8);
    }
}

/// A whole record of `fields` fields.
pub fn build_record(fields: u64, lengths: &mut FieldLengths, rng: &mut Rng, out: &mut Vec<u8>) {
    out.clear();
    for _ in 0..fields {
        let len = lengths.next(rng);
        push_field(out, len, rng);
    }
}

/// The byte ranges of a record's fields, or None if it is not a record.
pub fn field_ranges(record: &[u8]) -> Option<Vec<std::ops::Range<usize>>> {
    let mut ranges = Vec::new();
    let mut at = 0;
    while at < record.len() {
        let len = u32::from_le_bytes(record.get(at..at + 4)?.try_into().ok()?) as usize;
        let end = (at + 4).checked_add(len)?;
        if end > record.len() {
            return None;
        }
        ranges.push(at + 4..end);
        at = end;
    }
    Some(ranges)
}

/// Replaces field `field` of `record` with fresh bytes (YCSB's update of one
/// field, applied to the value read).
pub fn replace_field(
    record: &[u8],
    field: usize,
    lengths: &mut FieldLengths,
    rng: &mut Rng,
    out: &mut Vec<u8>,
) -> Option<()> {
    let ranges = field_ranges(record)?;
    out.clear();
    for (i, r) in ranges.iter().enumerate() {
        if i == field {
            let len = lengths.next(rng);
            push_field(out, len, rng);
        } else {
            out.extend_from_slice(&record[r.start - 4..r.end]);
        }
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(text: &str) -> Result<Workload, String> {
        Workload::from_properties(&Properties::parse(text)).map(|(w, _)| w)
    }

    #[test]
    fn defaults_and_overrides() {
        let w = workload("recordcount=10\noperationcount=5\n").unwrap();
        assert_eq!((w.fieldcount, w.fieldlength, w.threadcount), (10, 100, 1));
        assert_eq!(w.requestdistribution, Distribution::Uniform);
        assert!(!w.writeallfields && w.insertorder == InsertOrder::Hashed);
        assert_eq!(w.insertcount, 10);
        let (_, warnings) = Workload::from_properties(&Properties::parse(
            "recordcount=1\nmongodb.url=x\nworkload=com.yahoo.ycsb.workloads.CoreWorkload\n",
        ))
        .unwrap();
        assert_eq!(
            warnings,
            vec!["ignoring unknown workload property 'mongodb.url'".to_string()]
        );
    }

    #[test]
    fn impossible_values_name_their_key() {
        let cases = [
            ("recordcount=-5", "recordcount"),
            (
                "recordcount=10\nreadproportion=0.5\nupdateproportion=0.1",
                "must be 1",
            ),
            ("recordcount=10\nreadproportion=1.5", "readproportion"),
            (
                "recordcount=10\nrequestdistribution=pareto",
                "requestdistribution",
            ),
            (
                "recordcount=10\nreadproportion=0.05\nupdateproportion=0\nscanproportion=0.95",
                "range scans",
            ),
            ("recordcount=10\nzipfianconstant=1.2", "zipfianconstant"),
            ("recordcount=10\nthreadcount=0", "threadcount"),
            ("recordcount=10\nthreadcount=100000", "from 1 to 1024"),
            ("recordcount=10\nfieldcount=0", "fieldcount"),
            ("recordcount=10\ntarget=-3", "target"),
            ("recordcount=10\ninsertstart=20", "insertstart"),
            ("recordcount=10\nreadallfields=maybe", "readallfields"),
            (
                "recordcount=10\ninsertcount=11",
                "must not exceed recordcount 10",
            ),
            (
                "recordcount=10\ninsertstart=18446744073709551615\ninsertcount=1",
                "must not exceed",
            ),
            (
                "recordcount=10\noperationcount=5\ninsertcount=0",
                "the load inserts no records",
            ),
            ("recordcount=10\nfieldlength=4294967297", "at most 1024 MiB"),
            (
                "recordcount=10\nfieldcount=18446744073709551615",
                "at most 1024 MiB",
            ),
            (
                "recordcount=10\nreadproportion=1",
                "counting the defaults updateproportion=0.05",
            ),
            (
                "recordcount=10\nworkload=site.ycsb.workloads.TimeSeriesWorkload",
                "not YCSB's CoreWorkload",
            ),
        ];
        for (text, needle) in cases {
            let err = workload(text).expect_err(text);
            assert!(err.contains(needle), "{text}: {err}");
        }
    }

    #[test]
    fn flags_take_any_case_and_a_run_without_a_count_lasts_its_time() {
        let w = workload("recordcount=10\nwriteallfields=True\nreadallfields=FALSE\n").unwrap();
        assert!(w.writeallfields);
        assert_eq!(w.run_operations(), 0);
        let w = workload("recordcount=10\nmaxexecutiontime=5\n").unwrap();
        assert_eq!(w.run_operations(), u64::MAX);
        assert_eq!(w.describe_run(), "operations for 5 s");
        // What a store that cannot grow (LMDB's map) is sized for.
        let inserting = "recordcount=10\nmaxexecutiontime=8\ninsertproportion=1\n\
                         readproportion=0\nupdateproportion=0\n";
        assert_eq!(workload(inserting).unwrap().run_inserts(), 16_000_000);
        let throttled = format!("{inserting}target=100\n");
        assert_eq!(workload(&throttled).unwrap().run_inserts(), 800);
    }

    #[test]
    fn latest_keys_stay_within_the_loaded_part() {
        let w =
            workload("recordcount=2000\ninsertstart=1000\nrequestdistribution=latest\n").unwrap();
        let mut chooser = w.key_chooser();
        let mut rng = Rng::new(5);
        for _ in 0..100_000 {
            let k = chooser.next(1999, &mut rng);
            assert!((1000..=1999).contains(&k), "{k}");
        }
    }

    #[test]
    fn records_have_the_configured_shape_and_updates_touch_one_field() {
        let w = workload("recordcount=1\nfieldcount=4\nfieldlength=50\n").unwrap();
        let mut lengths = w.field_lengths();
        let mut rng = Rng::new(1);
        let mut rec = Vec::new();
        build_record(w.fieldcount, &mut lengths, &mut rng, &mut rec);
        let ranges = field_ranges(&rec).unwrap();
        assert_eq!(ranges.len(), 4);
        assert!(ranges.iter().all(|r| r.len() == 50));
        let mut updated = Vec::new();
        replace_field(&rec, 2, &mut lengths, &mut rng, &mut updated).unwrap();
        let new_ranges = field_ranges(&updated).unwrap();
        for i in 0..4 {
            let same = rec[ranges[i].clone()] == updated[new_ranges[i].clone()];
            assert_eq!(same, i != 2, "field {i}");
        }
        assert!(field_ranges(&[1, 0, 0, 0]).is_none());
    }
}
