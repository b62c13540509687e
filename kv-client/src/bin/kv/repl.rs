//! The interactive prompt: `kv --server ADDR` with no command. Lines are
//! split as redis-cli splits them (see `quoting`), parsed as the command
//! line's commands, and answered the way redis-cli answers: `OK`, `(nil)`,
//! `(integer) 1`, `(error) ...`, values quoted unless `--raw`. History is
//! kept in `~/.onekv_history` for sessions typed at a terminal (a script's
//! lines may hold values nobody wants kept).

use std::ffi::OsString;
use std::io::{IsTerminal, Write};
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
    /// Standard output is closed: nobody reads the answers.
    Unread(std::io::Error),
}

/// Runs the prompt until `quit`, end of input or Ctrl-C; fails if there
/// is no prompt to run, when its input cannot be read (not UTF-8), or when
/// its answers cannot be written (standard output closed): the lines left
/// are not run.
pub fn run(kv: &mut Store, server: &str, style: Style) -> Result<(), String> {
    let mut editor =
        rustyline::DefaultEditor::new().map_err(|e| format!("cannot open the prompt: {e}"))?;
    let history = history_file().filter(|_| std::io::stdin().is_terminal());
    if let Some(path) = &history {
        // No history yet is the common case, not an error.
        let _ = editor.load_history(path);
    }
    let prompt = format!("{server}> ");
    let mut ended = Ok(());
    loop {
        match editor.readline(&prompt) {
            Ok(line) if line.trim().is_empty() => {}
            Ok(line) => {
                let _ = editor.add_history_entry(line.as_str());
                match answer(kv, &line, style) {
                    Flow::Continue => {}
                    Flow::Quit => break,
                    Flow::Unread(e) => break ended = Err(format!("writing an answer: {e}")),
                }
            }
            Err(ReadlineError::Eof | ReadlineError::Interrupted) => break,
            Err(e) => break ended = Err(format!("reading the prompt: {e}")),
        }
    }
    if let Some(path) = &history {
        let _ = editor.save_history(path);
    }
    ended
}

/// Prints to standard output.
fn say(text: std::fmt::Arguments) -> std::io::Result<()> {
    std::io::stdout().lock().write_fmt(text)
}

/// Goes on after an answer written, or ends the session when nobody reads.
fn flow_after(written: std::io::Result<()>) -> Flow {
    match written {
        Ok(()) => Flow::Continue,
        Err(e) => Flow::Unread(e),
    }
}

fn history_file() -> Option<PathBuf> {
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".onekv_history"))
}

/// Runs one line and prints its answer.
fn answer(kv: &mut Store, line: &str, style: Style) -> Flow {
    let mut words = match quoting::split(line) {
        Ok(w) => w,
        Err(e) => return flow_after(print_error(&e.to_string(), style)),
    };
    // Commands are case-insensitive, as in redis-cli.
    if let Some(first) = words.first_mut() {
        first.make_ascii_lowercase();
    }
    match words.first().map(Vec::as_slice) {
        Some(b"quit" | b"exit") => return Flow::Quit,
        Some(b"help") => return flow_after(show_help(&words[1..])),
        _ => {}
    }
    let line = match Line::try_parse_from(words.into_iter().map(OsString::from_vec)) {
        Ok(l) => l,
        Err(e) => return flow_after(say(format_args!("{}", e.render()))),
    };
    if let Command::Put {
        value: None,
        value_file: None,
        ..
    } = line.command
    {
        let refused = "put takes a VALUE (or --value-file) at the prompt";
        return flow_after(print_error(refused, style));
    }
    flow_after(match execute(kv, line.command) {
        Ok(outcome) => print_outcome(outcome, style),
        Err(e) => print_error(&e, style),
    })
}

fn show_help(topic: &[Vec<u8>]) -> std::io::Result<()> {
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

fn print_outcome(outcome: Outcome, style: Style) -> std::io::Result<()> {
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
    written.and_then(|()| out.flush())
}

fn print_error(message: &str, style: Style) -> std::io::Result<()> {
    if style == Style::Raw {
        say(format_args!("{message}\n"))
    } else {
        say(format_args!("(error) {message}\n"))
    }
}
