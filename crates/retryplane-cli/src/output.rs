//! What every command prints the same way: diagnostics, durations, tables, stderr notes.

use std::fmt::{self, Write as _};
use std::io::{self, Write as _};
use std::time::Duration;

use retryplane_policy::Diagnostic;
use serde::{Serialize, Serializer};
use unicode_width::UnicodeWidthStr;

/// `--format`: how stdout is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Lines for people and `grep`.
    #[default]
    Text,
    /// One JSON document for programs.
    Json,
}

/// Writes `text` to stdout. A reader that went away (`retryplane validate … | head -1`) is not
/// an error: the exit code still tells what was found. Nothing to write touches nothing: `serve`
/// prints its own lines as it goes, and a write of them that failed (and was logged) must not
/// turn its clean stop into an error when the same bytes fail again here.
pub fn stdout(text: &str) -> io::Result<()> {
    if text.is_empty() {
        return Ok(());
    }
    let mut out = io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Ok(()),
        other => other,
    }
}

/// Writes `text` to stdout ([`stdout`]), then each of `notes` as a line on stderr: for a
/// command whose stderr lines explain its report, so that at a terminal they come under it
/// (`main` prints a report's stdout only after the command has returned).
pub fn stdout_then_notes<S: fmt::Display>(text: &str, notes: &[S]) -> io::Result<()> {
    stdout(text)?;
    for line in notes {
        note(format_args!("{line}"));
    }
    Ok(())
}

/// Prints `retryplane: error: MESSAGE` on stderr. A closed stderr is ignored: there is nowhere
/// left to complain to.
pub fn error(message: fmt::Arguments<'_>) {
    let _ = writeln!(io::stderr().lock(), "retryplane: error: {message}");
}

/// Prints one line on stderr (summaries, notes), ignoring a closed stderr.
pub fn note(message: fmt::Arguments<'_>) {
    let _ = writeln!(io::stderr().lock(), "{message}");
}

/// Appends `FILE:LINE:COLUMN: SEVERITY: PATH: MESSAGE` and a newline (SPEC §5), or
/// `FILE: SEVERITY: PATH: MESSAGE` for a diagnostic with no place (a stored version's): one line
/// per problem, whatever the file's names hold. Paths and messages carry names as written (a key
/// `"a\nb"`), and the file is named as given, so control characters in them are escaped
/// ([`OneLine`]).
pub fn push_diagnostic_line(out: &mut String, file: &str, diag: &Diagnostic) {
    // A diagnostic of a stored version (a rollback's warnings) has no place in any file.
    let place = if diag.loc.is_known() {
        format!(":{}", diag.loc)
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "{}{place}: {}: {}: {}",
        OneLine(file),
        diag.severity.as_str(),
        OneLine(&diag.path),
        OneLine(&diag.message)
    );
}

/// Control characters written as escapes, so a name from a file stays on one line.
pub use retryplane_policy::diag::OneLine;

/// A name an agent sent (agent id, service, endpoint), for a terminal: control characters
/// escaped, so it stays in its cell and cannot move the cursor or change colours, and in
/// double quotes when it is not a plain word ([`retryplane_policy::diag::LogValue`]: white space, `"`, `\\`, an escaped
/// character), so that `web 1` reads as one name and a name spelling out `\u{202e}` is told
/// from the character. Empty stays empty (a cell shows `-`).
pub fn name(s: &str) -> String {
    if s.is_empty() {
        return String::new();
    }
    retryplane_policy::diag::LogValue(s).to_string()
}

/// Free text an agent sent (a NACK's error, a label), on one line: runs of white space become
/// one space, other control characters are escaped ([`OneLine`]).
pub fn spaced(s: &str) -> String {
    OneLine(&s.split_whitespace().collect::<Vec<_>>().join(" ")).to_string()
}

/// One diagnostic as JSON: `{file, line, column, severity, path, message}` (SPEC §5).
#[derive(Debug, Serialize)]
pub struct JsonDiagnostic<'a> {
    /// The file as named on the command line (`<stdin>` for `-`).
    pub file: &'a str,
    /// 1-based line; `null` when unknown (a stored version's diagnostic).
    pub line: Option<u32>,
    /// 1-based column; `null` when unknown.
    pub column: Option<u32>,
    /// `error` or `warning`.
    pub severity: &'static str,
    /// The field path, such as `endpoints.payments.backoff.max`.
    pub path: &'a str,
    /// What is wrong.
    pub message: &'a str,
}

impl<'a> JsonDiagnostic<'a> {
    /// `diag`, found in `file`.
    pub fn new(file: &'a str, diag: &'a Diagnostic) -> Self {
        Self {
            file,
            line: diag.loc.is_known().then_some(diag.loc.line),
            column: diag.loc.is_known().then_some(diag.loc.column),
            severity: diag.severity.as_str(),
            path: &diag.path,
            message: &diag.message,
        }
    }
}

/// Pretty JSON and a final newline. Serializing plain structs cannot fail; if it ever did, the
/// error would be reported like any I/O error.
pub fn json(value: &impl Serialize) -> anyhow::Result<String> {
    let mut text = serde_json::to_string_pretty(value)?;
    text.push('\n');
    Ok(text)
}

/// A duration in milliseconds: printed `1600ms` (decimals only when not whole, `337.5ms`),
/// serialized as a JSON number of milliseconds (`1600`, `337.5`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Millis(pub Duration);

impl Millis {
    fn whole(self) -> Option<u64> {
        let d = self.0;
        d.subsec_nanos()
            .is_multiple_of(1_000_000)
            .then(|| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    fn fractional(self) -> f64 {
        self.0.as_secs_f64() * 1000.0
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.whole() {
            Some(ms) => write!(f, "{ms}ms"),
            None => {
                let text = format!("{:.6}", self.fractional());
                write!(f, "{}ms", text.trim_end_matches('0'))
            }
        }
    }
}

impl Serialize for Millis {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.whole() {
            Some(ms) => s.serialize_u64(ms),
            None => s.serialize_f64(self.fractional()),
        }
    }
}

/// Column alignment in [`table`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Align {
    /// Text.
    Left,
    /// Numbers.
    Right,
}

/// Lays out `rows` (the first is the header) in columns two spaces apart, each line indented
/// by `indent`, trailing spaces trimmed. Columns are as wide as a terminal shows their cells
/// (an ideograph takes two columns, a combining mark none), not as their count of characters.
pub fn table(out: &mut String, indent: &str, align: &[Align], rows: &[Vec<String>]) {
    use unicode_width::UnicodeWidthStr as _;
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.width())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in rows {
        let mut line = String::from(indent);
        for (c, cell) in row.iter().enumerate() {
            if c > 0 {
                line.push_str("  ");
            }
            let pad = " ".repeat(widths[c].saturating_sub(cell.width()));
            match align.get(c).copied().unwrap_or(Align::Left) {
                Align::Left => {
                    line.push_str(cell);
                    line.push_str(&pad);
                }
                Align::Right => {
                    line.push_str(&pad);
                    line.push_str(cell);
                }
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
}

/// The report of a command refused because its policy file has errors: exactly what
/// `validate` prints for that file, in the requested format, with the failure outcome.
pub fn invalid_file_report(
    file: &str,
    diagnostics: &[Diagnostic],
    format: Format,
) -> anyhow::Result<crate::Report> {
    let stdout = match format {
        Format::Text => {
            let mut out = String::new();
            for d in diagnostics {
                push_diagnostic_line(&mut out, file, d);
            }
            out
        }
        Format::Json => json(
            &diagnostics
                .iter()
                .map(|d| JsonDiagnostic::new(file, d))
                .collect::<Vec<_>>(),
        )?,
    };
    Ok(crate::Report {
        stdout,
        outcome: crate::Outcome::Failure,
    })
}

/// `text` cut to `width` terminal columns (an ideograph takes two, a combining mark none), the
/// last one `…` when cut (before the closing quote of a quoted name).
pub fn fit(text: &str, width: usize) -> String {
    if UnicodeWidthStr::width(text) <= width {
        return text.to_owned();
    }
    // A quoted name (`output::name`) keeps its closing quote, so it still reads as one.
    if width >= 3
        && let Some(inner) = text.strip_prefix('"').and_then(|t| t.strip_suffix('"'))
    {
        return format!("\"{}\"", fit(inner, width - 2));
    }
    cut(text, width)
}

/// `text` cut to `width` terminal columns, the last one `…` when cut, whatever it holds
/// ([`fit`] keeps a quoted name's closing quote; text that is not a name may open and end
/// with quotes of its own).
pub fn cut(text: &str, width: usize) -> String {
    if UnicodeWidthStr::width(text) <= width {
        return text.to_owned();
    }
    if width == 0 {
        return String::new();
    }
    let mut out = String::new();
    let mut used = 0;
    for c in text.chars() {
        let w = unicode_width::UnicodeWidthChar::width(c).unwrap_or(0);
        if used + w > width - 1 {
            break;
        }
        used += w;
        out.push(c);
    }
    out.push('…');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_keeps_quotes_as_written_and_a_fit_keeps_a_quoted_names_closing_one() {
        let reason = format!("\"{}\"", "x".repeat(20));
        assert_eq!(cut(&reason, 8), "\"xxxxxx…");
        assert_eq!(fit(&reason, 8), "\"xxxxx…\"");
        assert_eq!(cut("short", 8), "short");
        assert_eq!(cut("ab", 0), "");
    }

    #[test]
    fn a_diagnostic_without_a_place_is_printed_without_one() {
        use retryplane_policy::yaml::Loc;
        use serde_json::{Value, json};
        let mut d = Diagnostic::warning(Loc::UNKNOWN, "endpoints.a.max_attempts", "many attempts");
        let mut out = String::new();
        push_diagnostic_line(&mut out, "v2", &d);
        assert_eq!(
            out,
            "v2: warning: endpoints.a.max_attempts: many attempts\n"
        );
        let json = serde_json::to_value(JsonDiagnostic::new("v2", &d)).unwrap();
        assert_eq!(
            (&json["line"], &json["column"]),
            (&Value::Null, &Value::Null)
        );
        d.loc = Loc { line: 3, column: 5 };
        out.clear();
        push_diagnostic_line(&mut out, "f.yaml", &d);
        assert_eq!(
            out,
            "f.yaml:3:5: warning: endpoints.a.max_attempts: many attempts\n"
        );
        let json = serde_json::to_value(JsonDiagnostic::new("f.yaml", &d)).unwrap();
        assert_eq!((&json["line"], &json["column"]), (&json!(3), &json!(5)));
    }

    #[test]
    fn a_name_is_quoted_unless_it_is_a_plain_word() {
        assert_eq!(name("checkout-1"), "checkout-1");
        assert_eq!(name(""), "");
        assert_eq!(name("spaces agent  x"), "\"spaces agent  x\"");
        assert_eq!(name("a\u{1b}[2J"), "\"a\\u{1b}[2J\"");
        assert_eq!(name("\\u{202e}"), "\"\\\\u{202e}\"");
        // Free text keeps its spaces unquoted.
        assert_eq!(spaced("bad  value\n here"), "bad value here");
    }

    #[test]
    fn millis_print_whole_numbers_without_decimals() {
        assert_eq!(Millis(Duration::from_millis(1600)).to_string(), "1600ms");
        assert_eq!(Millis(Duration::ZERO).to_string(), "0ms");
        assert_eq!(
            Millis(Duration::from_micros(337_500)).to_string(),
            "337.5ms"
        );
        assert_eq!(
            serde_json::to_string(&Millis(Duration::from_secs(2))).unwrap(),
            "2000"
        );
        assert_eq!(
            serde_json::to_string(&Millis(Duration::from_micros(337_500))).unwrap(),
            "337.5"
        );
    }

    #[test]
    fn tables_align_columns_and_trim_trailing_spaces() {
        let mut out = String::new();
        let rows = vec![
            vec!["retry".to_owned(), "ceiling".to_owned(), "note".to_owned()],
            vec!["1".to_owned(), "100ms".to_owned(), String::new()],
            vec!["10".to_owned(), "2000ms".to_owned(), "x".to_owned()],
        ];
        table(
            &mut out,
            "  ",
            &[Align::Right, Align::Right, Align::Left],
            &rows,
        );
        assert_eq!(
            out,
            "  retry  ceiling  note\n      1    100ms\n     10   2000ms  x\n"
        );
    }

    #[test]
    fn tables_align_cells_by_the_columns_a_terminal_gives_them() {
        let mut out = String::new();
        let rows = vec![
            vec!["AUTHOR".to_owned(), "HASH".to_owned()],
            vec!["张三".to_owned(), "ab".to_owned()],
            vec!["e\u{301}".to_owned(), "cd".to_owned()],
        ];
        table(&mut out, "", &[Align::Left, Align::Left], &rows);
        assert_eq!(out, "AUTHOR  HASH\n张三    ab\ne\u{301}       cd\n");
    }
}
