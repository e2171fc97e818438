//! Numbers as the product writes them: every finite `f64` a policy can hold reads back exactly
//! from its rendering, and `validate`'s messages and hints write numbers as the rendering does
//! (a dot and a signed exponent, which YAML 1.1 readers also take for numbers).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::excessive_precision,
    clippy::collapsible_if
)]

use retryplane_policy::document::Field;
use retryplane_policy::{PolicyDocument, parse, render, validate, yaml};

fn doc_of(src: &str) -> (Option<PolicyDocument>, Vec<retryplane_policy::Diagnostic>) {
    let root = yaml::parse(src.as_bytes()).expect("yaml");
    let mut diags = Vec::new();
    let doc = parse::document(&root, &mut diags);
    (doc, diags)
}

fn with_ratio(v: f64) -> PolicyDocument {
    let (doc, diags) = doc_of("version: 1\nendpoints:\n  a: {budget: {ratio: 0.5}}\n");
    assert!(diags.is_empty(), "{diags:?}");
    let mut doc = doc.unwrap();
    doc.endpoints[0].overlay.budget.ratio = Some(Field::new(v));
    doc
}

/// Every finite f64 (negatives, subnormals, extremes, random bit patterns) renders to text our
/// parser reads back as the same number.
#[test]
fn every_finite_f64_reads_back() {
    let mut vals = vec![
        -1e-7,
        -1.5e20,
        5e-324,
        -5e-324,
        f64::MIN_POSITIVE,
        -f64::MIN_POSITIVE,
        f64::MAX,
        f64::MIN,
        1e16,
        1e15,
        9.999999999999999e15,
        1e-5,
        1e-4,
        0.0001,
        123e300,
        2.5e-310,
        4.9406564584124654e-324,
        1.0,
        -1.0,
        0.0,
    ];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = f64::from_bits(x);
        if v.is_finite() {
            vals.push(v);
        }
    }
    let mut bad = Vec::new();
    for v in vals {
        let text = render::to_yaml(&with_ratio(v));
        let (doc, diags) = doc_of(&text);
        let got = doc.and_then(|d| {
            d.endpoints[0]
                .overlay
                .budget
                .ratio
                .as_ref()
                .map(|f| f.value)
        });
        let ok = got.map(f64::to_bits) == Some(v.to_bits()) || (v == 0.0 && got == Some(0.0));
        if !ok || !diags.is_empty() {
            bad.push((
                v,
                got,
                text.lines()
                    .find(|l| l.contains("ratio"))
                    .map(str::to_owned),
            ));
        }
        // Exponent forms carry a dot in the mantissa and a signed exponent.
        if let Some(line) = text.lines().find(|l| l.contains("ratio:")) {
            if let Some((m, e)) = line.split_once('e') {
                if !m.contains("ratio") || !e.is_empty() {
                    let m = m.rsplit(' ').next().unwrap();
                    if m.chars().any(|c| c.is_ascii_digit()) {
                        assert!(m.contains('.'), "{line}");
                        assert!(e.starts_with('+') || e.starts_with('-'), "{line}");
                    }
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{} bad, first: {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
}

/// `validate` quotes an out-of-range ratio in the form the renderer writes (and a YAML 1.1
/// reader takes for a number), not as hundreds of digits.
#[test]
fn validate_quotes_large_numbers_as_render_does() {
    let (doc, diags) = doc_of("version: 1\nendpoints:\n  a: {budget: {ratio: 1.5e+300}}\n");
    assert!(diags.is_empty(), "{diags:?}");
    let mut diags = Vec::new();
    validate::check(&doc.unwrap(), &mut diags);
    let msg = diags
        .iter()
        .find(|d| d.path.contains("ratio"))
        .map(|d| d.message.clone())
        .expect("an error on the ratio");
    assert!(msg.len() < 120, "message is {} chars: {msg}", msg.len());
    assert!(msg.contains("1.5e+300"), "{msg}");
}

/// The percentage hint quotes the number to write in the renderer's form (`1.0e-7`), not the
/// form b3e5667 says Python's YAML reads as a string (`1e-7`).
#[test]
fn percent_hint_quotes_number_as_render_does() {
    let (_, diags) = doc_of("version: 1\nendpoints:\n  a: {budget: {ratio: 0.00001%}}\n");
    let msg = diags
        .iter()
        .find(|d| d.path.contains("ratio"))
        .map(|d| d.message.clone())
        .expect("an error on the ratio");
    // The number quoted must read back as the ratio meant (1e-7), in the renderer's form.
    let quoted = msg
        .split("write ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .unwrap();
    assert_eq!(quoted, "1.0e-7", "{msg}");
}

/// A percentage written with an exponent gets the hundredth of the number as written too
/// (a division by 100 rounds `1e-5` to `1.0000000000000001e-7`).
#[test]
fn percent_hint_with_an_exponent_names_the_hundredth() {
    for (written, meant) in [
        ("1e-5%", 1e-7_f64),
        ("7e-1%", 0.007),
        ("1E-3%", 1e-5),
        ("2.5e1%", 0.25),
        ("5.%", 0.05),
        ("+5%", 0.05),
    ] {
        let (_, diags) = doc_of(&format!(
            "version: 1\nendpoints:\n  a: {{budget: {{ratio: {written}}}}}\n"
        ));
        let msg = diags
            .iter()
            .find(|d| d.path.contains("ratio"))
            .map(|d| d.message.clone())
            .expect("an error on the ratio");
        let quoted = msg
            .split("write ")
            .nth(1)
            .and_then(|r| r.split(' ').next())
            .unwrap();
        assert_eq!(
            quoted.parse::<f64>().ok().map(f64::to_bits),
            Some(meant.to_bits()),
            "{written}: {msg}"
        );
    }
}

/// A percentage over 100 is not answered with a number to write that is itself out of range.
#[test]
fn a_percentage_over_100_gets_no_hint_to_write_a_ratio_over_1() {
    let (_, diags) = doc_of("version: 1\nendpoints:\n  a: {budget: {ratio: 150%}}\n");
    let msg = diags
        .iter()
        .find(|d| d.path.contains("ratio"))
        .map(|d| d.message.clone())
        .expect("an error on the ratio");
    assert!(!msg.contains("write"), "{msg}");
    assert!(msg.contains("`150%` would be 1.5"), "{msg}");
}

/// Every other message that quotes a number read as a float writes it as the rendering does,
/// not as hundreds of digits: a duration written as a bare float, and the hint for a comma in
/// a flow mapping.
#[test]
fn other_messages_quote_floats_as_render_does() {
    let (doc, mut diags) = doc_of(
        "version: 1\nendpoints:\n  a:\n    budget: {ratio: 1.5e300, 2}\n    deadline: 1e300\n",
    );
    if let Some(doc) = doc {
        validate::check(&doc, &mut diags);
    }
    let quoted: Vec<&str> = diags.iter().map(|d| d.message.as_str()).collect();
    assert!(quoted.iter().any(|m| m.contains("1.0e+300")), "{quoted:#?}");
    assert!(quoted.iter().any(|m| m.contains("1.5e+300")), "{quoted:#?}");
    assert!(quoted.iter().all(|m| m.len() < 200), "{quoted:#?}");
}

/// The rendered forms of the edge values, as a file holds them.
#[test]
fn edge_forms() {
    let line = |v: f64| {
        let text = render::to_yaml(&with_ratio(v));
        let l = text
            .lines()
            .find(|l| l.contains("ratio"))
            .unwrap()
            .to_owned();
        l.split("ratio: ")
            .nth(1)
            .unwrap()
            .trim_end_matches('}')
            .trim()
            .to_owned()
    };
    let got: Vec<String> = [
        -1e-7,
        -1.5e20,
        5e-324,
        -5e-324,
        f64::MAX,
        f64::MIN,
        1e16,
        -0.0,
        1e-5,
    ]
    .into_iter()
    .map(line)
    .collect();
    assert_eq!(
        got,
        [
            "-1.0e-7",
            "-1.5e+20",
            "5.0e-324",
            "-5.0e-324",
            "1.7976931348623157e+308",
            "-1.7976931348623157e+308",
            "1.0e+16",
            "0.0",
            "1.0e-5"
        ]
    );
}
