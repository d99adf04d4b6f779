//! The client address that rate limits key on. Behind a reverse proxy or an ingress the
//! TCP peer is the proxy, so every client would share one limit: when the peer is one of
//! `[server] trusted_proxies`, the client is the right-most `X-Forwarded-For` address
//! that is not a trusted proxy (the addresses to its left were written by the client or
//! by proxies nobody vouches for, so they are never believed). Otherwise, the peer.
//! A limit per address keys on `rate_limit_key`: an IPv6 client is its /64, the block a
//! single host is usually given, so one host cannot spread over its addresses.

use std::net::{IpAddr, SocketAddr};

use actix_web::{HttpRequest, web};

use crate::api::AppState;
use crate::config::IpBlock;

/// The address of the client that sent `req`; `None` when the server cannot tell (a
/// request on a Unix socket).
pub fn client_addr(req: &HttpRequest) -> Option<IpAddr> {
    let trusted = req
        .app_data::<web::Data<AppState>>()
        .map(|s| s.settings.server.trusted_proxy_blocks())
        .unwrap_or_default();
    let forwarded = req
        .headers()
        .get_all("x-forwarded-for")
        .filter_map(|v| v.to_str().ok());
    client_addr_of(req.peer_addr().map(|a| a.ip()), forwarded, &trusted)
}

/// The key a limit per client address counts under: the client's IPv4 address, or the
/// /64 of its IPv6 address (`2001:db8:1:2::/64`); `unknown` when there is none.
pub fn rate_limit_key(req: &HttpRequest) -> String {
    client_addr(req).map_or_else(|| "unknown".to_owned(), key_of)
}

/// An IPv4 address as itself, an IPv6 address as its /64.
pub fn key_of(ip: IpAddr) -> String {
    match canonical(ip) {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => {
            let net = u128::from(v6) & !((1u128 << 64) - 1);
            format!("{}/64", std::net::Ipv6Addr::from(net))
        }
    }
}

/// The client address from the TCP peer, the `X-Forwarded-For` header values (in the
/// order received) and the trusted proxies.
pub fn client_addr_of<'a>(
    peer: Option<IpAddr>,
    forwarded_for: impl IntoIterator<Item = &'a str>,
    trusted: &[IpBlock],
) -> Option<IpAddr> {
    let peer = peer.map(canonical)?;
    let is_trusted = |ip: IpAddr| trusted.iter().any(|b| b.contains(ip));
    if !is_trusted(peer) {
        return Some(peer);
    }
    let hops: Vec<&str> = forwarded_for
        .into_iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .collect();
    // Right to left: each trusted proxy vouches for the hop before it.
    let mut nearest = peer;
    for hop in hops.iter().rev() {
        let Some(ip) = parse_hop(hop) else {
            // A trusted proxy passed on something that is no address: the proxy is as far
            // as anyone can tell.
            return Some(nearest);
        };
        if !is_trusted(ip) {
            return Some(ip);
        }
        nearest = ip;
    }
    Some(nearest)
}

/// `203.0.113.7`, `203.0.113.7:4711`, `2001:db8::1` or `[2001:db8::1]:4711`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    hop.parse::<IpAddr>()
        .ok()
        .or_else(|| hop.parse::<SocketAddr>().ok().map(|s| s.ip()))
        .map(canonical)
}

/// An IPv4-mapped IPv6 address as its IPv4 address, so one client has one key.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(list: &[&str]) -> Vec<IpBlock> {
        list.iter().map(|b| IpBlock::parse(b).unwrap()).collect()
    }

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    #[test]
    fn without_trusted_proxies_the_peer_is_the_client() {
        let got = client_addr_of(ip("10.0.0.2"), ["1.2.3.4"], &[]);
        assert_eq!(got, ip("10.0.0.2"));
    }

    #[test]
    fn behind_trusted_proxies_the_rightmost_untrusted_hop_is_the_client() {
        let trusted = blocks(&["10.0.0.0/8", "192.0.2.1"]);
        // The client forged a first hop; the proxies appended the real one.
        let got = client_addr_of(
            ip("10.0.0.2"),
            ["6.6.6.6, 203.0.113.7", "192.0.2.1"],
            &trusted,
        );
        assert_eq!(got, ip("203.0.113.7"));
        // With a port, and bracketed IPv6.
        assert_eq!(
            client_addr_of(ip("10.0.0.2"), ["203.0.113.7:4711"], &trusted),
            ip("203.0.113.7")
        );
        assert_eq!(
            client_addr_of(ip("10.0.0.2"), ["[2001:db8::1]:80"], &trusted),
            ip("2001:db8::1")
        );
        // No header: the proxy itself.
        assert_eq!(client_addr_of(ip("10.0.0.2"), [], &trusted), ip("10.0.0.2"));
        // Garbage from a trusted proxy: the proxy.
        assert_eq!(
            client_addr_of(ip("10.0.0.2"), ["1.2.3.4, nonsense"], &trusted),
            ip("10.0.0.2")
        );
        // An untrusted peer's header is never read.
        assert_eq!(
            client_addr_of(ip("198.51.100.9"), ["203.0.113.7"], &trusted),
            ip("198.51.100.9")
        );
        // A mapped IPv4 peer counts as its IPv4 address.
        assert_eq!(
            client_addr_of(ip("::ffff:10.0.0.2"), ["203.0.113.7"], &trusted),
            ip("203.0.113.7")
        );
    }

    #[test]
    fn an_ipv6_client_is_limited_as_its_64() {
        let a = key_of("2001:db8:1:2::1".parse().unwrap());
        let b = key_of("2001:db8:1:2:ffff::9".parse().unwrap());
        assert_eq!(a, "2001:db8:1:2::/64");
        assert_eq!(a, b);
        assert_ne!(a, key_of("2001:db8:1:3::1".parse().unwrap()));
        assert_eq!(key_of("203.0.113.7".parse().unwrap()), "203.0.113.7");
        assert_eq!(key_of("::ffff:203.0.113.7".parse().unwrap()), "203.0.113.7");
    }

    #[test]
    fn blocks_parse_and_match() {
        assert!(IpBlock::parse("10.0.0.0/33").is_none());
        assert!(IpBlock::parse("10.0.0.0/").is_none());
        assert!(IpBlock::parse("nonsense").is_none());
        let b = IpBlock::parse("2001:db8::/32").unwrap();
        assert!(b.contains("2001:db8:1::5".parse().unwrap()));
        assert!(!b.contains("2001:db9::5".parse().unwrap()));
        assert!(!b.contains("10.0.0.1".parse().unwrap()));
        let all = IpBlock::parse("0.0.0.0/0").unwrap();
        assert!(all.contains("203.0.113.7".parse().unwrap()));
    }
}
