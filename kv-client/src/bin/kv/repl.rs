//! The interactive prompt: `kv --server ADDR` with no command. Lines are
//! split as redis-cli splits them (see `quoting`), parsed as the command
//! line's commands, and answered the way redis-cli answers: `OK`, `(nil)`,
//! `(integer) 1`, `(error) ...`, values quoted unless `--raw`. History is
//! kept in `~/.onekv_history`.

use std::ffi::OsString;
use std::io::Write;
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;

use clap::{CommandFactory, Parser};
use rustyline::error::ReadlineError;

use crate::quoting;
use crate::store::Store;
use crate::{execute, Command, Outcome};

/// Commands at the kv prompt (one line parsed).
#[derive(Parser)]
#[command(no_binary_name = true, name = "kv>")]
struct Line {
    #[command(subcommand)]
    command: Command,
}

enum Flow {
    Continue,
    Quit,
}

/// Runs the prompt until `quit`, end of input or Ctrl-C; fails only if
/// there is no prompt to run.
pub fn run(kv: &mut Store, server: &str, style: Style) -> Result<(), String> {
    let mut editor =
        rustyline::DefaultEditor::new().map_err(|e| format!("cannot open the prompt: {e}"))?;
    let history = history_file();
    if let Some(path) = &history {
        // No history yet is the common case, not an error.
        let _ = editor.load_history(path);
    }
    let prompt = format!("{server}> ");
    loop {
        match editor.readline(&prompt) {
            Ok(line) if line.trim().is_empty() => {}
            Ok(line) => {
                let _ = editor.add_history_entry(line.as_str());
                if let Flow::Quit = answer(kv, &line, style) {
                    break;
                }
            }
            Err(ReadlineError::Eof | ReadlineError::Interrupted) => break,
            Err(e) => {
                eprintln!("kv: reading the prompt: {e}");
                break;
            }
        }
    }
    if let Some(path) = &history {
        let _ = editor.save_history(path);
    }
    Ok(())
}

/// Prints to standard output; a closed one ends the session at the next
/// read anyway, so a failed write is not an error here.
fn say(text: std::fmt::Arguments) {
    let _ = std::io::stdout().lock().write_fmt(text);
}

fn history_file() -> Option<PathBuf> {
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".onekv_history"))
}

/// Runs one line and prints its answer.
fn answer(kv: &mut Store, line: &str, style: Style) -> Flow {
    let mut words = match quoting::split(line) {
        Ok(w) => w,
        Err(e) => {
            print_error(&e.to_string(), style);
            return Flow::Continue;
        }
    };
    // Commands are case-insensitive, as in redis-cli.
    if let Some(first) = words.first_mut() {
        first.make_ascii_lowercase();
    }
    match words.first().map(Vec::as_slice) {
        Some(b"quit" | b"exit") => return Flow::Quit,
        Some(b"help") => {
            show_help(&words[1..]);
            return Flow::Continue;
        }
        _ => {}
    }
    let line = match Line::try_parse_from(words.into_iter().map(OsString::from_vec)) {
        Ok(l) => l,
        Err(e) => {
            say(format_args!("{}", e.render()));
            return Flow::Continue;
        }
    };
    if let Command::Put {
        value: None,
        value_file: None,
        ..
    } = line.command
    {
        print_error("put takes a VALUE (or --value-file) at the prompt", style);
        return Flow::Continue;
    }
    match execute(kv, line.command) {
        Ok(outcome) => print_outcome(outcome, style),
        Err(e) => print_error(&e, style),
    }
    Flow::Continue
}

fn show_help(topic: &[Vec<u8>]) {
    let mut help = Line::command().after_help(
        "Also: help COMMAND, quit. Quote values with spaces or binary bytes: \
         put k \"a b\\x00\".",
    );
    match topic.first() {
        Some(name) => {
            let name = String::from_utf8_lossy(name).to_lowercase();
            match help.find_subcommand_mut(&name) {
                Some(sub) => say(format_args!("{}", sub.render_long_help())),
                None => say(format_args!("(error) no command '{name}'; try help\n")),
            }
        }
        None => say(format_args!("{}", help.render_help())),
    }
}

/// How answers are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    /// As redis-cli does: `(integer) 1`, `(nil)`, values quoted.
    Annotated,
    /// Values as they are (`--raw`).
    Raw,
}

fn print_outcome(outcome: Outcome, style: Style) {
    let mut out = std::io::stdout().lock();
    let raw = style == Style::Raw;
    let written = match (outcome, raw) {
        (Outcome::Stored, _) => writeln!(out, "OK"),
        (Outcome::Value(Some(v)), true) => out.write_all(&v).and_then(|()| writeln!(out)),
        (Outcome::Value(Some(v)), false) => writeln!(out, "{}", quoting::quote(&v)),
        (Outcome::Value(None), true) => writeln!(out),
        (Outcome::Value(None), false) => writeln!(out, "(nil)"),
        (Outcome::Deleted(d), true) => writeln!(out, "{}", u8::from(d)),
        (Outcome::Deleted(d), false) => writeln!(out, "(integer) {}", u8::from(d)),
        (Outcome::Counter(n), true) => writeln!(out, "{n}"),
        (Outcome::Counter(n), false) => writeln!(out, "(integer) {n}"),
        (Outcome::Report(lines), _) => lines.iter().try_for_each(|l| writeln!(out, "{l}")),
    };
    // A closed terminal ends the session at the next read anyway.
    let _ = written;
}

fn print_error(message: &str, style: Style) {
    if style == Style::Raw {
        say(format_args!("{message}\n"));
    } else {
        say(format_args!("(error) {message}\n"));
    }
}
