//! The OpenAI API's wire format: request parsing and validation ([`request`], over the
//! field reader in [`fields`]) and response bodies ([`response`]).

pub mod fields;
pub mod request;
pub mod response;
