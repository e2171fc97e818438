//! gRPC status codes by name and number, and the HTTP status checks of SPEC §1.

/// A gRPC status code (the 17 codes of the gRPC spec).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum GrpcCode {
    /// 0
    Ok = 0,
    /// 1
    Cancelled = 1,
    /// 2
    Unknown = 2,
    /// 3
    InvalidArgument = 3,
    /// 4
    DeadlineExceeded = 4,
    /// 5
    NotFound = 5,
    /// 6
    AlreadyExists = 6,
    /// 7
    PermissionDenied = 7,
    /// 8
    ResourceExhausted = 8,
    /// 9
    FailedPrecondition = 9,
    /// 10
    Aborted = 10,
    /// 11
    OutOfRange = 11,
    /// 12
    Unimplemented = 12,
    /// 13
    Internal = 13,
    /// 14
    Unavailable = 14,
    /// 15
    DataLoss = 15,
    /// 16
    Unauthenticated = 16,
}

const NAMES: [(GrpcCode, &str); 17] = [
    (GrpcCode::Ok, "OK"),
    (GrpcCode::Cancelled, "CANCELLED"),
    (GrpcCode::Unknown, "UNKNOWN"),
    (GrpcCode::InvalidArgument, "INVALID_ARGUMENT"),
    (GrpcCode::DeadlineExceeded, "DEADLINE_EXCEEDED"),
    (GrpcCode::NotFound, "NOT_FOUND"),
    (GrpcCode::AlreadyExists, "ALREADY_EXISTS"),
    (GrpcCode::PermissionDenied, "PERMISSION_DENIED"),
    (GrpcCode::ResourceExhausted, "RESOURCE_EXHAUSTED"),
    (GrpcCode::FailedPrecondition, "FAILED_PRECONDITION"),
    (GrpcCode::Aborted, "ABORTED"),
    (GrpcCode::OutOfRange, "OUT_OF_RANGE"),
    (GrpcCode::Unimplemented, "UNIMPLEMENTED"),
    (GrpcCode::Internal, "INTERNAL"),
    (GrpcCode::Unavailable, "UNAVAILABLE"),
    (GrpcCode::DataLoss, "DATA_LOSS"),
    (GrpcCode::Unauthenticated, "UNAUTHENTICATED"),
];

impl GrpcCode {
    /// The canonical upper-case name (`UNAVAILABLE`).
    pub fn name(self) -> &'static str {
        NAMES[self as usize].1
    }

    /// The code for a canonical name; exact, upper case.
    pub fn from_name(name: &str) -> Option<Self> {
        NAMES.iter().find(|(_, n)| *n == name).map(|(c, _)| *c)
    }

    /// The code for a number, `0..=16`.
    pub fn from_i32(code: i32) -> Option<Self> {
        usize::try_from(code)
            .ok()
            .and_then(|i| NAMES.get(i))
            .map(|(c, _)| *c)
    }

    /// Every canonical name, for suggestions.
    pub fn names() -> impl Iterator<Item = &'static str> {
        NAMES.iter().map(|(_, n)| *n)
    }
}

/// 4xx statuses that may succeed when repeated; any other 4xx in `retry_on` is a warning.
pub const RETRYABLE_4XX: [u16; 3] = [408, 425, 429];

/// Whether `status` is a status code at all (`100..=599`).
pub fn is_http_status(status: i64) -> bool {
    (100..=599).contains(&status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_numbers_round_trip() {
        for i in 0..17 {
            let code = GrpcCode::from_i32(i).unwrap();
            assert_eq!(code as i32, i);
            assert_eq!(GrpcCode::from_name(code.name()), Some(code));
        }
        assert_eq!(GrpcCode::from_i32(17), None);
        assert_eq!(GrpcCode::from_i32(-1), None);
        assert_eq!(GrpcCode::from_name("unavailable"), None);
    }
}
