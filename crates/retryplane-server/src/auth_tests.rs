use std::path::Path;
use std::sync::Arc;

use tonic::Code;
use tonic::service::Interceptor as _;

use super::*;

const FILE: &str = "\
tokens:
  - {name: fleet, role: agent, secret: agent-secret-0123456789}
  - {name: alice, role: admin, secret: admin-secret-0123456789}
";

fn tokens() -> Arc<TokenSet> {
    let path = Path::new("tokens.yaml");
    Arc::new(TokenSet::of(path, Tokens::parse(FILE, path).unwrap()))
}

fn request(authorization: Option<&str>) -> Request<()> {
    let mut request = Request::new(());
    if let Some(value) = authorization {
        request
            .metadata_mut()
            .insert("authorization", value.parse().unwrap());
    }
    request
}

fn call(role: Role, authorization: Option<&str>) -> Result<Request<()>, Status> {
    Guard::new(Some(tokens()), role).call(request(authorization))
}

fn invalid(text: &str) -> String {
    Tokens::parse(text, Path::new("/etc/retryplane/tokens.yaml"))
        .unwrap_err()
        .to_string()
}

#[test]
fn right_token_passes_and_names_the_caller() {
    let request = call(Role::Admin, Some("Bearer admin-secret-0123456789")).unwrap();
    assert_eq!(
        request.extensions().get::<TokenName>(),
        Some(&TokenName("alice".to_owned()))
    );
    assert!(call(Role::Agent, Some("bearer agent-secret-0123456789")).is_ok());
}

#[test]
fn wrong_secret_is_unauthenticated() {
    let status = call(Role::Admin, Some("Bearer admin-secret-0123456788")).unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    assert!(!status.message().contains("0123456788"));
}

#[test]
fn a_prefix_of_a_secret_is_unauthenticated() {
    let status = call(Role::Admin, Some("Bearer admin-secret")).unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
}

#[test]
fn missing_or_malformed_header_is_unauthenticated() {
    for header in [
        None,
        Some("admin-secret-0123456789"),
        Some("Basic xyz"),
        Some("Bearer "),
    ] {
        let status = call(Role::Admin, header).unwrap_err();
        assert_eq!(status.code(), Code::Unauthenticated, "{header:?}");
    }
}

#[test]
fn agent_token_on_the_admin_service_is_permission_denied() {
    let status = call(Role::Admin, Some("Bearer agent-secret-0123456789")).unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
    assert!(status.message().contains("fleet"));
    let status = call(Role::Agent, Some("Bearer admin-secret-0123456789")).unwrap_err();
    assert_eq!(status.code(), Code::PermissionDenied);
}

#[test]
fn no_tokens_file_admits_everyone_without_a_name() {
    let request = Guard::new(None, Role::Admin).call(request(None)).unwrap();
    assert!(request.extensions().get::<TokenName>().is_none());
}

#[test]
fn debug_output_never_shows_secrets() {
    let shown = format!("{:?}", tokens());
    assert!(shown.contains("alice"));
    assert!(!shown.contains("secret-0123456789"));
}

#[test]
fn short_secret_is_refused_naming_the_file() {
    let err = invalid("tokens: [{name: a, role: admin, secret: short}]");
    assert!(err.contains("/etc/retryplane/tokens.yaml"), "{err}");
    assert!(
        err.contains("tokens[0] (`a`): secret is shorter than 16 bytes"),
        "{err}"
    );
    assert!(!err.contains("short}"), "{err}");
}

#[test]
fn a_secret_longer_than_a_request_can_carry_is_refused() {
    // The listeners refuse headers past 16 KiB (HTTP 431) before reading the token: a client
    // with a 20,000-byte secret got `UNKNOWN: grpc-status header missing` on every call.
    let secret = "s".repeat(MAX_SECRET_LEN + 1);
    let err = invalid(&format!(
        "tokens: [{{name: a, role: admin, secret: {secret}}}]"
    ));
    assert!(
        err.contains("tokens[0] (`a`): secret is 4097 bytes, longer than the 4096 bytes"),
        "{err}"
    );
    assert!(!err.contains(&secret[..64]), "{err}");
    let longest = "s".repeat(MAX_SECRET_LEN);
    let text = format!("tokens: [{{name: a, role: admin, secret: {longest}}}]");
    assert!(Tokens::parse(&text, Path::new("/etc/retryplane/tokens.yaml")).is_ok());
}

#[test]
fn secrets_no_header_can_carry_are_refused_without_showing_them() {
    for secret in [
        "\" spaced-secret-0123456789 \"",
        "\"spaced-secret-0123456789\\t\"",
        "\"bell\\ain-the-middle-0123456789\"",
        "\"a\\tsecret-with-a-tab-inside\"",
        "\"пароль-очень-длинный-секрет-0123456789\"",
    ] {
        let err = invalid(&format!(
            "tokens: [{{name: a, role: admin, secret: {secret}}}]"
        ));
        assert!(err.contains("tokens[0] (`a`): secret "), "{err}");
        assert!(
            err.contains("white space") || err.contains("other than printable ASCII"),
            "{err}"
        );
        assert!(!err.contains("0123456789"), "{err}");
    }
    // Refused for its white space whatever its length.
    let err = invalid("tokens: [{name: a, role: admin, secret: \"  short-secret-x  \"}]");
    assert!(err.contains("white space"), "{err}");
    // Spaces inside a secret are fine (gRPC metadata may carry them).
    {
        let secret = "a secret with spaces inside";
        let inside = format!("tokens: [{{name: a, role: admin, secret: \"{secret}\"}}]");
        let path = Path::new("tokens.yaml");
        let tokens = Arc::new(TokenSet::of(path, Tokens::parse(&inside, path).unwrap()));
        let passed = Guard::new(Some(tokens), Role::Admin)
            .call(request(Some(&format!("Bearer {secret}"))))
            .unwrap();
        assert_eq!(
            passed.extensions().get::<TokenName>(),
            Some(&TokenName("a".to_owned()))
        );
    }
}

#[test]
fn empty_secret_is_refused() {
    let err = invalid("tokens: [{name: a, role: admin, secret: ''}]");
    assert!(err.contains("secret is shorter"), "{err}");
}

#[test]
fn duplicate_names_and_secrets_are_refused() {
    let err = invalid(
        "tokens:
  - {name: a, role: admin, secret: aaaaaaaaaaaaaaaaaaaa}
  - {name: a, role: agent, secret: bbbbbbbbbbbbbbbbbbbb}
  - {name: c, role: agent, secret: aaaaaaaaaaaaaaaaaaaa}
",
    );
    assert!(
        err.contains("tokens[1] (`a`): name is already used by tokens[0]"),
        "{err}"
    );
    assert!(
        err.contains("tokens[2] (`c`): same secret as tokens[0]"),
        "{err}"
    );
    assert!(!err.contains("aaaaaaaa"), "{err}");
}

#[test]
fn names_with_control_characters_are_refused_and_shown_escaped() {
    let err = invalid(
        "tokens:\n  - {name: \"ci\\nbot\\u001b[31m\", role: admin, secret: aaaaaaaaaaaaaaaaaaaa}\n",
    );
    assert!(
        err.contains(r"tokens[0] (`ci\nbot\u{1b}[31m`): name holds a control character"),
        "{err}"
    );
    assert!(!err.contains('\n') && !err.contains('\u{1b}'), "{err:?}");
}

#[test]
fn names_that_could_pass_for_another_are_refused() {
    for (name, problem) in [
        ("\"adm \"", "name starts or ends with white space"),
        ("\" adm\"", "name starts or ends with white space"),
        ("\"ad\\u200bm\"", "name holds an invisible or bidirectional"),
        ("\"\\ufeffadm\"", "name holds an invisible or bidirectional"),
    ] {
        let err = invalid(&format!(
            "tokens: [{{name: {name}, role: admin, secret: aaaaaaaaaaaaaaaaaaaa}}]"
        ));
        assert!(err.contains(problem), "{name}: {err}");
    }
}

#[test]
fn a_duplicate_key_is_named_in_the_file_s_own_words() {
    let err = invalid(
        "tokens:\n  - name: a\n    role: admin\n    secret: aaaaaaaaaaaaaaaaaaaa\n    secret: bbbbbbbbbbbbbbbbbbbb\n",
    );
    assert!(
        err.contains("duplicate key `secret` at line 5, column 5"),
        "{err}"
    );
    assert!(!err.contains("DuplicateKeyPolicy"), "{err}");
}

/// Each problem of an entry names the entry's line, as well as its place in the list.
#[test]
fn a_problem_names_the_line_of_its_token() {
    let err = invalid(
        "tokens:\n  - {name: a, role: admin, secret: aaaaaaaaaaaaaaaaaaaa}\n\n  - name: b\n    \
         role: admn\n    secret: short\n",
    );
    assert!(
        err.contains("line 4: tokens[1] (`b`): unknown role `admn`")
            && err.contains("line 4: tokens[1] (`b`): secret is shorter than 16 bytes")
            && !err.contains("tokens[0]"),
        "{err}"
    );
}

#[test]
fn unknown_role_is_refused() {
    let err = invalid("tokens: [{name: a, role: root, secret: aaaaaaaaaaaaaaaaaaaa}]");
    assert!(
        err.contains("unknown role `root` (expected `agent`, `admin` or `viewer`)"),
        "{err}"
    );
}

#[test]
fn a_role_swapped_with_its_secret_is_not_shown() {
    let err = invalid("tokens: [{name: ci, role: Zq8-very-long-real-secret-value, secret: admin}]");
    assert!(err.contains("unknown role (not shown"), "{err}");
    assert!(!err.contains("Zq8"), "{err}");
}

#[test]
fn a_name_swapped_with_its_secret_is_not_shown() {
    // Secrets as tools make them (hex, a UUID, `token_urlsafe`, base64, a GitHub-style token),
    // and passphrases of words; each swapped with a name shorter than a secret, and with one
    // as long (which the file accepts as a secret, so only the role's problem is left).
    for secret in [
        "Zq8vR2mK9xT4wP7nL3bY6cH1",
        "9f1c2a7e4b8d3f60a1b2c3d4e5f60718",
        "3f2b8c1e-7a4d-4e9b-9c1a-2d5e6f708192",
        "Xk3_pQ9-vLm2Rt8sWz1yBn4cHd7fJg0e",
        "\"q2Vx9Lm/4RtP8sWz+1yBn4cHd7fJg0eKa3Tu5Oi6Yw=\"",
        "ghp_16C7e42F292c6912E7710c838347Ae178B4a",
        "correct-horse-battery-staple",
        "\"unsoiled chewy skater\"",
    ] {
        let bare = secret.trim_matches('"');
        for (role, name) in [
            ("agent", "checkout-agents"),
            ("agnet", "checkout-agents-eu"),
        ] {
            let err = invalid(&format!(
                "tokens: [{{name: {secret}, role: {role}, secret: {name}}}]"
            ));
            assert!(
                err.contains("tokens[0] (name not shown: 16 bytes or more"),
                "{err}"
            );
            assert!(!err.contains(&bare[..8]), "{err}");
        }
    }
    // A name shorter than any secret is quoted: it cannot be one.
    for name in ["checkout-agents", "ops", "ci.nightly/eu"] {
        let err = invalid(&format!(
            "tokens: [{{name: {name}, role: root, secret: aaaaaaaaaaaaaaaaaaaa}}]"
        ));
        assert!(err.contains(&format!("tokens[0] (`{name}`)")), "{err}");
    }
    let err = invalid("tokens: [{name: checkout-agents, role: agent, secret: short}]");
    assert!(err.contains("tokens[0] (`checkout-agents`)"), "{err}");
}

#[test]
fn a_secret_the_reader_quotes_in_its_message_is_not_shown() {
    // Malformed files the reader refuses, with a secret where a typo puts it; the reader
    // quotes what it found without escaping a quote inside it, so secrets with backticks and
    // double quotes are tried too.
    for secret in [
        "9081726354453627180918273645",
        "90817263544`53627180918273645",
        "9081`72635`44536`2718091827",
        "90817263544\"53627180918273645",
    ] {
        let s = secret;
        let shapes = [
            format!("tokens:\n  - {{name: ops, role: admin, secret={s}}}\n"),
            format!("tokens:\n  - name: ops\n    role: admin\n    secret={s}: x\n"),
            format!("tokens:\n  - {{name: ops, role: admin, secret: a, {s}: b, {s}: c}}\n"),
            format!("tokens:\n  - ops admin {s}\n"),
            format!("tokens: {s}\n"),
            format!("tokens:\n  - name: ops\n    role: admin\n    secret: !{s} x\n"),
            format!("tokens:\n  - name: ops\n    role: admin\n    secret: {{{s}: 1}}\n"),
            format!("tokens:\n  - name: ops\n    role: admin\n    secret: x\n    secret: {s}\n"),
            format!("tokens:\n  - {{name: ops, role: admin, secret: {s}, {s}}}\n"),
            format!("%TAG !{s}! tag:x\n---\ntokens: []\n"),
        ];
        for text in &shapes {
            let Err(err) = Tokens::parse(text, Path::new("/etc/retryplane/tokens.yaml")) else {
                continue;
            };
            let err = err.to_string();
            for part in secret.split(['`', '"']) {
                assert!(!err.contains(part), "the secret is shown: {err}");
            }
        }
    }
    // `=` typed for `:`: the place is still given.
    let err =
        invalid("tokens:\n  - {name: ops, role: admin, secret=9081726354453627180918273645}\n");
    assert!(
        err.contains("malformed") && err.contains("at line 2"),
        "{err}"
    );
    // A misspelt field is still named, and so is a duplicate key.
    let err = invalid("tokens: [{name: a, role: admin, secrte: aaaaaaaaaaaaaaaaaaaa}]");
    assert!(err.contains("`secrte`"), "{err}");
}

#[test]
fn unknown_fields_and_empty_lists_are_refused() {
    let err = invalid("tokens: [{name: a, role: admin, secret: aaaaaaaaaaaaaaaaaaaa, x: 1}]");
    assert!(err.contains("malformed"), "{err}");
    let err = invalid("tokens: []");
    assert!(err.contains("define at least one token"), "{err}");
}

#[test]
fn missing_file_error_names_it() {
    let err = Tokens::load(Path::new("/nonexistent/tokens.yaml")).unwrap_err();
    assert!(err.to_string().contains("/nonexistent/tokens.yaml"));
}

#[test]
fn a_reload_puts_the_file_s_tokens_in_force_and_a_bad_file_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokens.yaml");
    std::fs::write(&path, FILE).unwrap();
    let set = Arc::new(TokenSet::load(&path).unwrap());
    let admin = |secret: &str| {
        Guard::new(Some(set.clone()), Role::Admin).call(request(Some(&format!("Bearer {secret}"))))
    };
    let fleet = |secret: &str| {
        Guard::new(Some(set.clone()), Role::Agent).call(request(Some(&format!("Bearer {secret}"))))
    };
    assert!(admin("admin-secret-0123456789").is_ok());
    // alice's secret is rotated and a second agent token is added.
    std::fs::write(
        &path,
        "tokens:
  - {name: fleet, role: agent, secret: agent-secret-0123456789}
  - {name: batch, role: agent, secret: batch-secret-0123456789}
  - {name: alice, role: admin, secret: admin-secret-rotated-0001}
",
    )
    .unwrap();
    // Read when the file is, not before.
    assert!(fleet("batch-secret-0123456789").is_err());
    assert_eq!(set.reload().unwrap(), 3);
    assert!(fleet("batch-secret-0123456789").is_ok());
    assert!(admin("admin-secret-rotated-0001").is_ok());
    let old = admin("admin-secret-0123456789").unwrap_err();
    assert_eq!(old.code(), Code::Unauthenticated);
    // A file that cannot be used is refused, and the tokens in force stay.
    std::fs::write(&path, "tokens: []\n").unwrap();
    let err = set.reload().unwrap_err();
    assert!(err.to_string().contains("`tokens` is empty"), "{err}");
    assert!(admin("admin-secret-rotated-0001").is_ok());
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(set.reload(), Err(TokensError::Read { .. })));
    assert!(fleet("batch-secret-0123456789").is_ok());
    assert_eq!(set.current().len(), 3);
}

#[test]
fn a_credential_is_admitted_while_a_token_of_its_role_has_its_secret() {
    let set = tokens();
    let admitted = Guard::new(Some(set.clone()), Role::Agent)
        .call(request(Some("Bearer agent-secret-0123456789")))
        .unwrap();
    let credential = admitted.extensions().get::<Credential>().unwrap().clone();
    assert!(set.current().admits(&credential));
    let path = Path::new("tokens.yaml");
    // The same secret under another name still admits it; under the admin role it does not.
    let renamed = "tokens: [{name: other, role: agent, secret: agent-secret-0123456789}]";
    assert!(Tokens::parse(renamed, path).unwrap().admits(&credential));
    let promoted = "tokens: [{name: fleet, role: admin, secret: agent-secret-0123456789}]";
    assert!(!Tokens::parse(promoted, path).unwrap().admits(&credential));
    let rotated = "tokens: [{name: fleet, role: agent, secret: agent-secret-rotated-0001}]";
    assert!(!Tokens::parse(rotated, path).unwrap().admits(&credential));
}

#[test]
fn a_viewer_token_enters_the_admin_service_only() {
    let path = Path::new("tokens.yaml");
    let text = "tokens: [{name: dashboards, role: viewer, secret: viewer-secret-0123456789}]";
    let set = Arc::new(TokenSet::of(path, Tokens::parse(text, path).unwrap()));
    let bearer = Some("Bearer viewer-secret-0123456789");
    let admitted = Guard::new(Some(set.clone()), Role::Admin)
        .call(request(bearer))
        .unwrap();
    let credential = admitted.extensions().get::<Credential>().unwrap();
    assert_eq!(credential.role(), Role::Viewer);
    assert!(!credential.role().may_change());
    let refused = Guard::new(Some(set), Role::Agent)
        .call(request(bearer))
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert_eq!(
        refused.message(),
        "token `dashboards` has role `viewer`; this service needs role `agent`"
    );
    let agent = call(Role::Admin, Some("Bearer agent-secret-0123456789")).unwrap_err();
    assert_eq!(
        agent.message(),
        "token `fleet` has role `agent`; this service needs role `admin` (or `viewer`, for reads)"
    );
}

#[test]
fn an_agent_token_may_be_given_the_agent_ids_it_connects_as() {
    let path = Path::new("tokens.yaml");
    let text = "\
tokens:
  - {name: checkout, role: agent, secret: checkout-secret-0123456789, agent_ids: [checkout-*, cart-7]}
  - {name: fleet, role: agent, secret: agent-secret-0123456789}
";
    let set = Arc::new(TokenSet::of(path, Tokens::parse(text, path).unwrap()));
    let credential = |secret: &str| {
        Guard::new(Some(set.clone()), Role::Agent)
            .call(request(Some(&format!("Bearer {secret}"))))
            .unwrap()
            .extensions()
            .get::<Credential>()
            .unwrap()
            .clone()
    };
    let tokens = set.current();
    let checkout = credential("checkout-secret-0123456789");
    for allowed in ["checkout-", "checkout-eu-1", "cart-7"] {
        assert!(
            tokens.refuses_agent_id(&checkout, allowed).is_none(),
            "{allowed}"
        );
    }
    for refused in ["cart-70", "cart-", "Checkout-1", "payments-1", ""] {
        let status = tokens.refuses_agent_id(&checkout, refused).unwrap();
        assert_eq!(status.code(), Code::PermissionDenied, "{refused}");
    }
    assert_eq!(
        tokens
            .refuses_agent_id(&checkout, "pay\nments")
            .unwrap()
            .message(),
        "token `checkout` may not connect as agent id `pay\\nments`: its `agent_ids` in the \
         tokens file are `checkout-*`, `cart-7`"
    );
    // Without `agent_ids`, any id.
    let fleet = credential("agent-secret-0123456789");
    assert!(tokens.refuses_agent_id(&fleet, "payments-1").is_none());
    // A secret no token holds any more is not this refusal (`admits` tells that one).
    let rotated = "tokens: [{name: checkout, role: agent, secret: checkout-secret-rotated-01}]";
    let rotated = Tokens::parse(rotated, path).unwrap();
    assert!(rotated.refuses_agent_id(&checkout, "payments-1").is_none());
    assert!(!rotated.admits(&checkout));
}

#[test]
fn agent_ids_that_could_never_be_used_as_meant_are_refused() {
    let message = invalid(
        "\
tokens:
  - {name: a, role: agent, secret: agent-secret-0123456789, agent_ids: []}
  - {name: b, role: agent, secret: agent-secret-0123456780, agent_ids: [\"\", ok, \"x*y\", \"**\", \"a\\tb\"]}
  - {name: c, role: admin, secret: admin-secret-0123456789, agent_ids: [c-*]}
",
    );
    for part in [
        "tokens[0] (`a`): `agent_ids` is empty, so no agent could connect with this token",
        "tokens[1] (`b`): agent_ids[0] is empty",
        "tokens[1] (`b`): agent_ids[2] `x*y` holds a `*` before its end",
        "tokens[1] (`b`): agent_ids[3] `**` holds a `*` before its end",
        "tokens[1] (`b`): agent_ids[4] `a\\tb` holds a control character",
        "tokens[2] (`c`): `agent_ids` is for agent tokens; a token of role `admin` does not \
         connect as an agent",
    ] {
        assert!(message.contains(part), "{part}\nnot in: {message}");
    }
    assert!(!message.contains("agent_ids[1]"), "{message}");
    let long = format!(
        "tokens: [{{name: d, role: agent, secret: agent-secret-0123456789, agent_ids: [\"{}*\"]}}]",
        "x".repeat(retryplane_proto::MAX_HELLO_FIELD_BYTES + 1)
    );
    assert!(
        invalid(&long).contains("is longer than an agent id may be (256 bytes)"),
        "{}",
        invalid(&long)
    );
    // Exactly as long as an id may be, with its `*`: fine.
    let longest = format!(
        "tokens: [{{name: d, role: agent, secret: agent-secret-0123456789, agent_ids: [\"{}*\"]}}]",
        "x".repeat(retryplane_proto::MAX_HELLO_FIELD_BYTES)
    );
    assert!(Tokens::parse(&longest, Path::new("t.yaml")).is_ok());
}

/// A `max_agents` written past what an integer holds (20 digits, or 100, which read as a float)
/// is refused as too large, not as "not a whole number of at least 1", which it is; a negative
/// one still is not a whole number of at least 1.
#[test]
fn a_max_agents_too_large_for_an_integer_is_refused_as_too_large() {
    for written in ["99999999999999999999".to_owned(), "9".repeat(100)] {
        let message = invalid(&format!(
            "tokens: [{{name: a, role: agent, secret: agent-secret-0123456789, max_agents: {written}}}]"
        ));
        assert!(
            message.contains("tokens[0] (`a`): `max_agents` is past any count this file takes"),
            "{} digits: {message}",
            written.len()
        );
        assert!(!message.contains("whole number of at least 1"), "{message}");
    }
    let negative = invalid(&format!(
        "tokens: [{{name: a, role: agent, secret: agent-secret-0123456789, max_agents: -{}}}]",
        "9".repeat(100)
    ));
    assert!(
        negative.contains("must be a whole number of at least 1"),
        "{negative}"
    );
}

#[test]
fn an_agent_token_may_cap_its_connected_agents_and_only_an_agent_token() {
    let path = Path::new("tokens.yaml");
    let text = "\
tokens:
  - {name: checkout, role: agent, secret: checkout-secret-0123456789, max_agents: 500}
  - {name: fleet, role: agent, secret: agent-secret-0123456789}
";
    let set = Arc::new(TokenSet::of(path, Tokens::parse(text, path).unwrap()));
    let max_agents = |secret: &str| {
        let admitted = Guard::new(Some(set.clone()), Role::Agent)
            .call(request(Some(&format!("Bearer {secret}"))))
            .unwrap();
        set.current()
            .max_agents(admitted.extensions().get::<Credential>().unwrap())
    };
    assert_eq!(max_agents("checkout-secret-0123456789"), Some(500));
    assert_eq!(max_agents("agent-secret-0123456789"), None);
    let message = invalid(
        "\
tokens:
  - {name: a, role: agent, secret: agent-secret-0123456789, max_agents: 0}
  - {name: b, role: viewer, secret: viewer-secret-0123456789, max_agents: 3}
",
    );
    for part in [
        "tokens[0] (`a`): `max_agents` is 0, so no agent could connect with this token",
        "tokens[1] (`b`): `max_agents` is for agent tokens; a token of role `viewer`",
    ] {
        assert!(message.contains(part), "{part}\nnot in: {message}");
    }
    let negative = invalid(
        "tokens: [{name: a, role: agent, secret: agent-secret-0123456789, max_agents: -1}]",
    );
    assert!(
        negative.contains("tokens[0] (`a`): `max_agents` must be a whole number of at least 1"),
        "{negative}"
    );
    assert!(!negative.contains("agent-secret"), "{negative}");
    // A whole number in any YAML spelling of one, or in a string, is one (as it was when the
    // field was read as a number by the YAML reader).
    for written in [
        "\"3\"",
        "4294967296",
        "0x10",
        "+3",
        "1_000",
        "0o10",
        "\"0x10\"",
        "\"1_000\"",
        "\"0o10\"",
        "\" 3\"",
        "0X10",
        "0O10",
        "0B11",
    ] {
        let text = format!(
            "tokens: [{{name: a, role: agent, secret: agent-secret-0123456789, max_agents: {written}}}]"
        );
        assert!(
            Tokens::parse(&text, Path::new("t.yaml")).is_ok(),
            "{written}"
        );
    }
}

#[test]
fn agent_ids_and_max_agents_without_a_value_or_of_another_shape_are_named() {
    let entry = |rest: &str| {
        invalid(&format!(
            "tokens:\n  - name: a\n    role: agent\n    secret: agent-secret-0123456789\n{rest}"
        ))
    };
    for (rest, says) in [
        (
            "    agent_ids:\n    # - checkout-*\n",
            "tokens[0] (`a`): `agent_ids` has no value (its ids commented out?)",
        ),
        ("    agent_ids: ~\n", "`agent_ids` has no value"),
        (
            "    agent_ids: checkout-*\n",
            "tokens[0] (`a`): `agent_ids` is one value, not a list",
        ),
        (
            "    agent_ids: [checkout-*, ~]\n",
            "tokens[0] (`a`): agent_ids[1] is empty",
        ),
        (
            "    max_agents:\n",
            "tokens[0] (`a`): `max_agents` is without a value, so no agent could connect",
        ),
    ] {
        let message = entry(rest);
        assert!(message.contains(says), "{rest}: {message}");
    }
    let alias = entry("    agent_ids: [*]\n");
    assert!(alias.contains("malformed"), "{alias}");
}

#[test]
fn a_max_agents_left_without_a_value_is_refused_not_taken_for_no_limit() {
    // `max_agents: 0` is refused ("leave the field out for no limit of its own"); a key left
    // without its value (YAML null) is no more a limit of none than 0 is.
    for value in ["", "~", "null"] {
        let text = format!(
            "tokens:\n  - name: a\n    role: agent\n    secret: agent-secret-0123456789\n    \
             max_agents: {value}\n"
        );
        assert!(
            Tokens::parse(&text, Path::new("t.yaml")).is_err(),
            "`max_agents: {value}` was taken for no limit"
        );
    }
}

/// A FIFO at the tokens path is refused, not waited on: the file is read at start and on
/// SIGHUP, and a wait for a writer froze the start (and, when the reload was read in the loop
/// that waits for SIGTERM, SIGTERM with it).
#[cfg(any(target_os = "linux", target_os = "android"))]
#[test]
fn a_fifo_at_the_tokens_path_is_refused_not_waited_on() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("tokens.yaml");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let (tx, rx) = std::sync::mpsc::channel();
    let path = fifo.clone();
    std::thread::spawn(move || {
        let _ = tx.send(
            Tokens::load(&path)
                .map(|_| ())
                .map_err(|e| crate::ErrorChain(&e).to_string()),
        );
    });
    let Ok(loaded) = rx.recv_timeout(std::time::Duration::from_secs(5)) else {
        // Let the waiting open go, then fail.
        let _ = std::fs::OpenOptions::new().write(true).open(&fifo);
        panic!("the load waited on the FIFO");
    };
    let err = loaded.unwrap_err();
    assert!(
        err.contains("the tokens file is a FIFO or a socket"),
        "{err}"
    );
}

/// Reloads may run at once (a slow read on a thread of its own beside the ones after it): the
/// tokens of a read that ends after a later one was put in force are not, and it says so; the
/// later one's stay.
#[test]
fn a_read_that_ends_after_a_later_one_is_not_put_in_force() {
    let set = tokens();
    let path = Path::new("tokens.yaml");
    let with = |secret: &str| {
        Tokens::parse(
            &format!("tokens:\n  - {{name: alice, role: admin, secret: {secret}}}\n"),
            path,
        )
        .unwrap()
    };
    let slow = set.begin_reload();
    let later = set.begin_reload();
    assert_eq!(
        set.put_in_force(later, with("later-secret-0123456789"))
            .unwrap(),
        1
    );
    let refused = set
        .put_in_force(slow, with("older-secret-0123456789"))
        .unwrap_err();
    assert!(
        matches!(refused, TokensError::Superseded { .. }),
        "{refused}"
    );
    assert!(
        call(Role::Admin, Some("Bearer later-secret-0123456789")).is_err(),
        "the fixture's set"
    );
    let guard = |secret: &str| {
        Guard::new(Some(set.clone()), Role::Admin)
            .call(request(Some(&format!("Bearer {secret}"))))
            .map(|_| ())
            .map_err(|s| s.code())
    };
    assert_eq!(guard("later-secret-0123456789"), Ok(()));
    assert_eq!(guard("older-secret-0123456789"), Err(Code::Unauthenticated));
    // A read that begins after it is put in force as usual.
    let next = set.begin_reload();
    assert_eq!(
        set.put_in_force(next, with("next-secret-0123456789"))
            .unwrap(),
        1
    );
    assert_eq!(guard("next-secret-0123456789"), Ok(()));
}

/// A call whose connection a full listener closed to make room before its token was checked
/// is refused with UNAVAILABLE, not run (its answer could not be written: an Apply would be
/// stored with no one told); on a connection still open it is admitted, and keeps it.
#[test]
fn a_call_on_a_connection_closed_for_room_is_not_run() {
    let now = tokio::time::Instant::now();
    let set = tokens();
    for evicted in [true, false] {
        let streams = Arc::new(crate::conn_idle::Streams::new(now).guarded(true));
        if evicted {
            assert!(streams.evict());
        }
        let mut request = request(Some("Bearer admin-secret-0123456789"));
        request
            .extensions_mut()
            .insert(crate::conn_idle::Admitted::on_streams(streams.clone()));
        let answer = Guard::new(Some(set.clone()), Role::Admin).call(request);
        if evicted {
            assert_eq!(answer.unwrap_err().code(), Code::Unavailable);
        } else {
            assert!(answer.is_ok());
            assert!(streams.is_admitted() && !streams.evict());
        }
    }
}

/// A tokens file owned by another user than the control plane's and root, or read through a
/// directory such a user owns or others may write without the sticky bit, is warned of, each
/// problem in its own line; one of its own or root's, in directories only their owners write
/// (or sticky ones), is not.
#[test]
fn a_tokens_file_another_user_owns_or_others_may_replace_is_warned_of() {
    let dir = |owner: u32, mode: u32| DirSeen {
        path: PathBuf::from("/etc/retryplane"),
        owner,
        mode,
    };
    for (owner, dirs) in [
        (Some(1000), vec![dir(1000, 0o700)]),
        (Some(0), vec![dir(0, 0o755), dir(1000, 0o750)]),
        (Some(1000), vec![dir(0, 0o1777)]),
        (Some(1000), vec![dir(1000, 0o1770)]),
        (Some(1000), vec![]),
        // On a read-only file system: not judged.
        (None, vec![]),
    ] {
        assert_eq!(
            loose_place(owner, 1000, &dirs),
            Vec::<String>::new(),
            "{owner:?} {dirs:?}"
        );
    }
    let found = loose_place(Some(1001), 1000, &[dir(1002, 0o755), dir(1000, 0o777)]);
    assert_eq!(found.len(), 3, "{found:?}");
    assert!(
        found[0].starts_with(
            "the tokens file is owned by user 1001, not by the control plane's user (1000) or \
             root: its owner can give themselves an admin token"
        ) && found[0].ends_with("or mount it read-only"),
        "{found:?}"
    );
    assert!(
        found[1].starts_with(
            "the directory /etc/retryplane holding the tokens file is owned by user 1002, not \
             by the control plane's user (1000) or root: its owner can put another tokens file"
        ),
        "{found:?}"
    );
    assert!(
        found[2].contains("put another tokens file in its place"),
        "{found:?}"
    );
    // A control plane run as root names root once.
    let found = loose_place(Some(1001), 0, &[]);
    assert!(
        found[0].contains("not by root (the control plane's user):"),
        "{found:?}"
    );
    for mode in [0o775, 0o757, 0o777, 0o770] {
        let found = loose_place(Some(1000), 1000, &[dir(1000, mode)]);
        assert!(
            found.len() == 1 && found[0].contains("may be written by users other than its owner"),
            "{mode:o}: {found:?}"
        );
    }
}

/// The directories a tokens file is read through are the path's own and the one the opened
/// file is in: a link's target in a directory others may write is warned of.
#[cfg(unix)]
#[test]
fn a_tokens_file_linked_from_a_safe_directory_into_a_writable_one_is_warned_of() {
    use std::os::unix::fs::PermissionsExt as _;
    let (log, _guard) = crate::test_logs::capture("retryplane_server=warn");
    let root = tempfile::tempdir().unwrap();
    let safe = root.path().join("safe");
    let open = root.path().join("open");
    std::fs::create_dir(&safe).unwrap();
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&safe, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let target = open.join("tokens.yaml");
    std::fs::write(&target, "tokens: []\n").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
    let link = safe.join("tokens.yaml");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let file = std::fs::File::open(&link).unwrap();
    warn_if_loose(&link, &file);
    let logged = log.text();
    assert!(
        logged.contains(&format!(
            "the directory {} holding the tokens file may be written",
            open.canonicalize().unwrap().display()
        )),
        "{logged}"
    );
    assert_eq!(logged.matches("the directory ").count(), 1, "{logged}");
}

/// A tokens file that lets no agent connect is warned of, and in API mode one that lets no one
/// change the policies; viewers alone, or no admin in file mode, are choices.
#[test]
fn a_tokens_file_missing_a_role_is_warned_of() {
    let path = Path::new("/etc/retryplane/tokens.yaml");
    let of = |text: &str| Tokens::parse(text, path).unwrap();
    let agents_only =
        of("tokens:\n  - {name: fleet, role: agent, secret: agent-secret-0123456789}\n");
    assert!(agents_only.missing_roles(false).is_empty());
    assert_eq!(
        agents_only.missing_roles(true),
        [
            "the tokens file holds no `admin` token: no one can apply, roll back or change the \
          policies through the admin API"
        ]
    );
    let viewers_only =
        of("tokens:\n  - {name: vic, role: viewer, secret: viewer-secret-0123456789}\n");
    assert_eq!(
        viewers_only.missing_roles(false),
        ["the tokens file holds no `agent` token: no agent can connect"]
    );
    assert_eq!(viewers_only.missing_roles(true).len(), 2);
    assert!(of(FILE).missing_roles(true).is_empty(), "{FILE}");
}

/// A tokens file its group or every user may write is warned of as one that lets them give
/// themselves a token, and as readable by every user too when it is; one its group may read
/// is not.
#[test]
fn a_tokens_file_others_may_write_or_every_user_read_is_warned_of() {
    for mode in [0o600, 0o400, 0o640, 0o440] {
        assert_eq!(loose_mode(mode), None, "{mode:o}");
    }
    for (mode, read) in [
        (0o620, false),
        (0o602, false),
        (0o660, false),
        (0o666, true),
        (0o622, false),
        (0o646, true),
    ] {
        let why = loose_mode(mode).unwrap_or_default();
        assert!(
            why.contains("may be changed by users other"),
            "{mode:o}: {why}"
        );
        assert_eq!(
            why.contains("every user may also read it"),
            read,
            "{mode:o}: {why}"
        );
    }
    for mode in [0o604, 0o644, 0o444] {
        let why = loose_mode(mode).unwrap_or_default();
        assert!(why.contains("readable by every user"), "{mode:o}: {why}");
    }
}

/// The agent listener's refusals are logged at warn, one line every `REFUSAL_WARN_INTERVAL`
/// with the count of those left out, naming the caller's address and the reason (a known token
/// of the wrong role by its name), never a secret.
#[tokio::test(start_paused = true)]
async fn refusals_are_warned_at_most_once_an_interval_with_the_count_left_out() {
    let (log, _guard) = crate::test_logs::capture("retryplane_server=warn");
    let mut guard = Guard::new(Some(tokens()), Role::Agent).warning();
    let from = |authorization: Option<&str>| {
        let mut request = request(authorization);
        let peer: std::net::SocketAddr = "[::ffff:10.1.2.3]:5000".parse().unwrap();
        request
            .extensions_mut()
            .insert(tonic::transport::server::TcpConnectInfo {
                local_addr: None,
                remote_addr: Some(peer),
            });
        request
    };
    let admin = "Bearer admin-secret-0123456789";
    assert_eq!(
        guard.call(from(Some(admin))).unwrap_err().code(),
        Code::PermissionDenied
    );
    for _ in 0..3 {
        guard
            .call(from(Some("Bearer wrong-secret-0123456789")))
            .unwrap_err();
    }
    let text = log.text();
    assert_eq!(text.matches("refused a caller").count(), 1, "{text}");
    assert!(text.contains(" WARN "), "{text}");
    assert!(text.contains("peer=10.1.2.3:5000"), "{text}");
    assert!(text.contains("token `alice` has role `admin`"), "{text}");
    assert!(text.contains("unlogged_before=0"), "{text}");
    assert!(!text.contains("secret-0123456789"), "{text}");

    tokio::time::advance(REFUSAL_WARN_INTERVAL - std::time::Duration::from_millis(1)).await;
    guard.call(from(None)).unwrap_err();
    assert_eq!(log.text().matches("refused a caller").count(), 1);
    tokio::time::advance(std::time::Duration::from_millis(1)).await;
    guard.call(from(None)).unwrap_err();
    let text = log.text();
    assert_eq!(text.matches("refused a caller").count(), 2, "{text}");
    assert!(text.contains("unlogged_before=4"), "{text}");
    assert!(text.contains("missing credentials"), "{text}");
    assert!(!text.contains("wrong-secret"), "{text}");

    // Admitted callers are not logged; a guard without `warning` logs at debug only.
    guard
        .call(from(Some("Bearer agent-secret-0123456789")))
        .unwrap();
    Guard::new(Some(tokens()), Role::Agent)
        .call(from(None))
        .unwrap_err();
    assert_eq!(log.text().matches("refused a caller").count(), 2);
}
