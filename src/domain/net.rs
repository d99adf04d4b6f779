//! Address ranges: which IP addresses are internal to the server's networks (loopback,
//! private, link-local and the like), the one rule for every target a member or an agent
//! chooses (hooks, git remotes, MCP URLs, the egress proxy).

use std::net::IpAddr;

/// An address a team's hook (or any other server-side call a member chooses the target
/// of) may not reach: loopback, private, link-local, unspecified, "this network", shared
/// (CGNAT `100.64.0.0/10`), benchmarking (`198.18.0.0/15`), reserved (`240.0.0.0/4`),
/// multicast or broadcast. In IPv6 also loopback, unspecified, multicast, unique-local,
/// link-local, site-local (`fec0::/10`), the mapped (`::ffff:a.b.c.d`) and compatible
/// (`::a.b.c.d`) forms of every refused IPv4 address, and the translated prefixes whole —
/// NAT64 `64:ff9b::/96` and `64:ff9b:1::/48`, 6to4 `2002::/16` — since a gateway turns
/// them into IPv4 addresses this check cannot see. The one address rule for every target
/// a member chooses (hooks, git remotes) or an agent reaches through the egress proxy.
pub fn is_internal(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || o[0] == 0
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
                || (o[0] == 198 && (o[1] & 0xfe) == 18)
                || (o[0] & 0xf0) == 240
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            // Mapped (`::ffff:a.b.c.d`) and compatible (`::a.b.c.d`; `::` and `::1` are
            // 0.0.0.0 and 0.0.0.1 there, both refused).
            if s[..5].iter().all(|x| *x == 0) && (s[5] == 0 || s[5] == 0xffff) {
                let [a, b] = s[6].to_be_bytes();
                let [c, d] = s[7].to_be_bytes();
                return is_internal(IpAddr::V4(std::net::Ipv4Addr::new(a, b, c, d)));
            }
            // NAT64: the well-known prefix `64:ff9b::/96` and the local-use `64:ff9b:1::/48`.
            let nat64 =
                s[0] == 0x64 && s[1] == 0xff9b && (s[2..6].iter().all(|x| *x == 0) || s[2] == 1);
            let six_to_four = s[0] == 0x2002;
            nat64
                || six_to_four
                || v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] & 0xffc0) == 0xfec0
        }
    }
}
