//! Protocol surfaces (SPEC section 6): the OpenAI-compatible `/v1`, the native `/runtime`
//! API and the operator `/admin` API, with one error envelope and the OpenAPI document.
//!
//! Empty until the runtime lifecycle issue.
