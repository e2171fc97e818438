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

fn tokens() -> Arc<Tokens> {
    Arc::new(Tokens::parse(FILE, Path::new("tokens.yaml")).unwrap())
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
fn secrets_no_header_can_carry_are_refused_without_showing_them() {
    for secret in [
        "\" spaced-secret-0123456789 \"",
        "\"spaced-secret-0123456789\\t\"",
        "\"bell\\ain-the-middle-0123456789\"",
    ] {
        let err = invalid(&format!(
            "tokens: [{{name: a, role: admin, secret: {secret}}}]"
        ));
        assert!(err.contains("tokens[0] (`a`): secret "), "{err}");
        assert!(
            err.contains("white space") || err.contains("control character"),
            "{err}"
        );
        assert!(!err.contains("0123456789"), "{err}");
    }
    // Refused for its white space whatever its length.
    let err = invalid("tokens: [{name: a, role: admin, secret: \"  short-secret-x  \"}]");
    assert!(err.contains("white space"), "{err}");
    // White space inside a secret is fine, a tab included (a header value may carry one).
    for (written, sent) in [
        ("a secret with spaces inside", "a secret with spaces inside"),
        (
            "a\\tsecret-with-a-tab-inside",
            "a\tsecret-with-a-tab-inside",
        ),
    ] {
        let inside = format!("tokens: [{{name: a, role: admin, secret: \"{written}\"}}]");
        let tokens = Arc::new(Tokens::parse(&inside, Path::new("tokens.yaml")).unwrap());
        let passed = Guard::new(Some(tokens), Role::Admin)
            .call(request(Some(&format!("Bearer {sent}"))))
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
fn unknown_role_is_refused() {
    let err = invalid("tokens: [{name: a, role: root, secret: aaaaaaaaaaaaaaaaaaaa}]");
    assert!(
        err.contains("unknown role `root` (expected `agent` or `admin`)"),
        "{err}"
    );
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
