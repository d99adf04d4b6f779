//! Browser sign-in: the authorization code flow with PKCE against the provider, and the
//! server-side sessions it ends in.
