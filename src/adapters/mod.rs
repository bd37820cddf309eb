//! Backend adapters (SPEC section 9): `RuntimeAdapter` turns a stable request into upstream
//! calls and upstream progress into events — `openai`, `scripted`, `http`.
//!
//! Empty until the runtime lifecycle issue: agents already declare their backend in the
//! compiled workspace ([`crate::workspace::Backend`]).
