//! Allow lists: which hosts and ports an agent may reach through the egress proxy.
//! An entry is an exact host (`api.anthropic.com`), a wildcard over the subdomains of a
//! suffix (`*.googleapis.com`, which does not match `googleapis.com` itself), any host
//! (`*`), or an IP literal (`10.0.0.7`, `[fd00::7]`); each with an optional `:port`.
//! Without a port an entry allows the default ports, 443 (https) and 80 (http).
//!
//! Only an exact entry reaches an internal address (loopback, private, link-local; see
//! `domain::net::is_internal`): a wildcard never does, so a name under an allowed suffix
//! that resolves into the server's networks is refused.

use std::fmt;
use std::net::IpAddr;

/// An address that leads to this host itself: loopback, or unspecified (a connection
/// to `0.0.0.0` reaches loopback), also in their IPv4-mapped IPv6 forms.
pub fn is_loopback(ip: IpAddr) -> bool {
    let ip = match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    ip.is_loopback() || ip.is_unspecified()
}

/// The port of a forward's `host:port`.
fn forward_port(target: &str) -> Option<u16> {
    target.rsplit_once(':')?.1.parse().ok()
}

/// The ports an entry without `:port` allows.
pub const DEFAULT_PORTS: [u16; 2] = [443, 80];
/// The longest entry accepted (a host name is at most 253 characters).
pub const MAX_ENTRY_LEN: usize = 260;

/// The host part of an entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum HostPattern {
    /// Exactly this name (lowercase, no trailing dot).
    Exact(String),
    /// Any name ending in `.<suffix>`.
    Suffix(String),
    /// This address.
    Ip(IpAddr),
    /// Any host.
    Any,
}

/// One allow-list entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AllowEntry {
    pub host: HostPattern,
    /// `None`: the default ports.
    pub port: Option<u16>,
}

/// Why an entry was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{entry}`: {why}")]
pub struct EntryError {
    pub entry: String,
    pub why: &'static str,
}

impl AllowEntry {
    /// Parse `host`, `*.suffix`, `*`, an IP literal (IPv6 in brackets), each with an
    /// optional `:port`.
    pub fn parse(raw: &str) -> Result<Self, EntryError> {
        let err = |why| EntryError {
            entry: raw.chars().take(80).collect(),
            why,
        };
        let s = raw.trim();
        if s.is_empty() {
            return Err(err("an entry must name a host"));
        }
        if s.len() > MAX_ENTRY_LEN {
            return Err(err("an entry is at most 260 characters"));
        }
        let (host, port) = if let Some(rest) = s.strip_prefix('[') {
            let (inside, after) = rest
                .split_once(']')
                .ok_or_else(|| err("an IPv6 address needs its closing `]`"))?;
            let ip: std::net::Ipv6Addr = inside
                .parse()
                .map_err(|_| err("not an IPv6 address between `[` and `]`"))?;
            let port = match after {
                "" => None,
                p => Some(p.strip_prefix(':').ok_or_else(|| err("expected `:port`"))?),
            };
            (HostPattern::Ip(IpAddr::V6(ip)), port)
        } else {
            let (h, p) = match s.rsplit_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (s, None),
            };
            (parse_host(h).map_err(err)?, p)
        };
        let port = match port {
            None => None,
            Some(p) => Some(parse_port(p).ok_or_else(|| err("the port must be 1 to 65535"))?),
        };
        Ok(Self { host, port })
    }

    /// The entry allows `port` (its own, or the default ports).
    fn allows_port(&self, port: u16) -> bool {
        match self.port {
            Some(p) => p == port,
            None => DEFAULT_PORTS.contains(&port),
        }
    }

    /// The entry names `host` (already normalised by `normalise_host`).
    fn matches_host(&self, host: &str) -> bool {
        match &self.host {
            HostPattern::Exact(name) => name == host,
            HostPattern::Suffix(suffix) => host
                .strip_suffix(suffix.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
            HostPattern::Ip(ip) => host.parse::<IpAddr>().is_ok_and(|h| h == *ip),
            HostPattern::Any => true,
        }
    }

    /// The host side of a loopback forward when the entry names a loopback address
    /// (`127.0.0.0/8`, `[::1]`, `localhost`) with its own port: the `host:port` the
    /// sandbox's bridge asks the proxy for when a connection arrives on that port of the
    /// sandbox's own loopback. An entry without a port (the default ports) forwards
    /// nothing.
    pub fn loopback_target(&self) -> Option<String> {
        let port = self.port?;
        match &self.host {
            HostPattern::Ip(ip) if ip.is_loopback() => Some(match ip {
                IpAddr::V6(v6) => format!("[{v6}]:{port}"),
                IpAddr::V4(v4) => format!("{v4}:{port}"),
            }),
            HostPattern::Exact(name) if name == "localhost" => Some(format!("localhost:{port}")),
            _ => None,
        }
    }

    /// The entry names the server's loopback: a loopback or unspecified address (also
    /// IPv4-mapped), `localhost` or a name under `.localhost`.
    pub fn names_loopback(&self) -> bool {
        match &self.host {
            HostPattern::Ip(ip) => is_loopback(*ip),
            HostPattern::Exact(name) => name == "localhost" || name.ends_with(".localhost"),
            HostPattern::Suffix(suffix) => suffix == "localhost" || suffix.ends_with(".localhost"),
            HostPattern::Any => false,
        }
    }

    /// Only an entry that names one host exactly may lead to an internal address.
    fn is_explicit(&self) -> bool {
        matches!(self.host, HostPattern::Exact(_) | HostPattern::Ip(_))
    }
}

impl fmt::Display for AllowEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            HostPattern::Exact(h) => f.write_str(h)?,
            HostPattern::Suffix(s) => write!(f, "*.{s}")?,
            HostPattern::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]")?,
            HostPattern::Ip(ip) => write!(f, "{ip}")?,
            HostPattern::Any => f.write_str("*")?,
        }
        if let Some(p) = self.port {
            write!(f, ":{p}")?;
        }
        Ok(())
    }
}

fn parse_port(p: &str) -> Option<u16> {
    if p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    p.parse::<u16>().ok().filter(|p| *p > 0)
}

fn parse_host(h: &str) -> Result<HostPattern, &'static str> {
    if h == "*" {
        return Ok(HostPattern::Any);
    }
    if let Ok(ip) = h.parse::<std::net::Ipv4Addr>() {
        return Ok(HostPattern::Ip(IpAddr::V4(ip)));
    }
    let (wild, name) = match h.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, h),
    };
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    if name.contains('*') {
        return Err("a wildcard is only `*` or a leading `*.`");
    }
    if !valid_name(&name) {
        return Err("not a host name (letters, digits, `-` and `.`; labels of 1 to 63)");
    }
    if wild && !name.contains('.') {
        return Err("a wildcard needs a suffix of two labels or more (`*.example.com`)");
    }
    Ok(if wild {
        HostPattern::Suffix(name)
    } else {
        HostPattern::Exact(name)
    })
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

/// A requested host as entries are matched against it: lowercase, no trailing dot, an
/// IPv6 literal without its brackets. `None` when it is no host name at all.
pub fn normalise_host(host: &str) -> Option<String> {
    let h = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = h.parse::<IpAddr>() {
        return Some(ip.to_string());
    }
    let name = h.strip_suffix('.').unwrap_or(h).to_ascii_lowercase();
    valid_name(&name).then_some(name)
}

/// What the list says about one host and port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No entry allows it.
    Refused,
    /// Allowed; `explicit` when an exact entry names it (internal addresses allowed).
    Allowed { explicit: bool },
}

/// An agent's allow list: the entries of its provider, the server and its team; and the
/// loopback forwards its sandbox gets (see `forward_loopback`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowList {
    entries: Vec<AllowEntry>,
    /// A team's entries: never the server's loopback (see `opens_loopback`).
    team: Vec<AllowEntry>,
    /// `host:port` targets of loopback forwards, one per port.
    forwards: Vec<String>,
}

impl AllowList {
    pub fn new(entries: impl IntoIterator<Item = AllowEntry>) -> Self {
        let mut list = Self::default();
        list.extend(entries);
        list
    }

    /// Parse every entry; the first bad one is the error.
    pub fn parse<S: AsRef<str>>(raw: &[S]) -> Result<Self, EntryError> {
        let entries = raw
            .iter()
            .map(|e| AllowEntry::parse(e.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::new(entries))
    }

    /// Add entries (a repeated one is kept once).
    pub fn extend(&mut self, entries: impl IntoIterator<Item = AllowEntry>) {
        for e in entries {
            if !self.entries.contains(&e) {
                self.entries.push(e);
            }
        }
    }

    pub fn entries(&self) -> &[AllowEntry] {
        &self.entries
    }

    /// Add a team's entries: they allow what they name, but never the server's loopback
    /// (its services are the server's, opened only by the server's settings).
    pub fn extend_team(&mut self, entries: impl IntoIterator<Item = AllowEntry>) {
        for e in entries {
            if !self.entries.contains(&e) && !self.team.contains(&e) {
                self.team.push(e);
            }
        }
    }

    /// Whether an exact entry of the server's (not a team's) names `host` on `port`: what
    /// a connection to the server's loopback needs.
    pub fn opens_loopback(&self, host: &str, port: u16) -> bool {
        let Some(host) = normalise_host(host) else {
            return false;
        };
        self.entries
            .iter()
            .any(|e| e.is_explicit() && e.allows_port(port) && e.matches_host(&host))
    }

    /// Give the sandbox a loopback forward for each of `entries` that names a loopback
    /// address with a port (and allow those entries): a connection to that port on the
    /// sandbox's own loopback reaches the same port on the host's, through the proxy and
    /// its check. Only the server's entries (its settings, its own `/mcp`) are given
    /// here, never a team's. One forward per port: the first entry naming it wins.
    pub fn forward_loopback(&mut self, entries: impl IntoIterator<Item = AllowEntry>) {
        for e in entries {
            if let (Some(target), Some(port)) = (e.loopback_target(), e.port)
                && port != super::BRIDGE_PORT
                && !self.forwards.iter().any(|f| forward_port(f) == Some(port))
            {
                self.forwards.push(target);
            }
            self.extend([e]);
        }
    }

    /// The loopback forwards, `host:port` each.
    pub fn forwards(&self) -> &[String] {
        &self.forwards
    }

    /// Whether `host` (as the client asked for it) on `port` is allowed, and whether an
    /// exact entry names it.
    pub fn check(&self, host: &str, port: u16) -> Verdict {
        let Some(host) = normalise_host(host) else {
            return Verdict::Refused;
        };
        let mut verdict = Verdict::Refused;
        for e in self
            .entries
            .iter()
            .chain(&self.team)
            .filter(|e| e.allows_port(port) && e.matches_host(&host))
        {
            if e.is_explicit() {
                return Verdict::Allowed { explicit: true };
            }
            verdict = Verdict::Allowed { explicit: false };
        }
        verdict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list(entries: &[&str]) -> AllowList {
        AllowList::parse(entries).unwrap()
    }

    #[test]
    fn exact_hosts_allow_the_default_ports_only() {
        let l = list(&["api.anthropic.com"]);
        assert_eq!(
            l.check("api.anthropic.com", 443),
            Verdict::Allowed { explicit: true }
        );
        assert_eq!(
            l.check("API.Anthropic.com.", 80),
            Verdict::Allowed { explicit: true }
        );
        assert_eq!(l.check("api.anthropic.com", 8443), Verdict::Refused);
        assert_eq!(l.check("anthropic.com", 443), Verdict::Refused);
        assert_eq!(l.check("evil-api.anthropic.com", 443), Verdict::Refused);
    }

    #[test]
    fn a_port_narrows_an_entry_to_that_port() {
        let l = list(&["localhost:8080"]);
        assert_eq!(
            l.check("localhost", 8080),
            Verdict::Allowed { explicit: true }
        );
        assert_eq!(l.check("localhost", 443), Verdict::Refused);
    }

    #[test]
    fn wildcards_match_subdomains_but_not_the_suffix_and_are_not_explicit() {
        let l = list(&["*.googleapis.com"]);
        assert_eq!(
            l.check("generativelanguage.googleapis.com", 443),
            Verdict::Allowed { explicit: false }
        );
        assert_eq!(
            l.check("a.b.googleapis.com", 443),
            Verdict::Allowed { explicit: false }
        );
        assert_eq!(l.check("googleapis.com", 443), Verdict::Refused);
        assert_eq!(l.check("evilgoogleapis.com", 443), Verdict::Refused);
        assert_eq!(
            list(&["*"]).check("anything.example", 443),
            Verdict::Allowed { explicit: false }
        );
    }

    #[test]
    fn ip_literals_are_explicit() {
        let l = list(&["127.0.0.1:9000", "[::1]:9000"]);
        assert_eq!(
            l.check("127.0.0.1", 9000),
            Verdict::Allowed { explicit: true }
        );
        assert_eq!(l.check("[::1]", 9000), Verdict::Allowed { explicit: true });
        assert_eq!(l.check("127.0.0.2", 9000), Verdict::Refused);
    }

    #[test]
    fn loopback_entries_with_a_port_become_forwards_once_per_port() {
        let mut l = list(&["api.anthropic.com"]);
        l.forward_loopback(
            [
                "127.0.0.1:9000",
                "[::1]:9000",
                "[::1]:9001",
                "localhost:9002",
                "127.0.0.2:9003",
                "127.0.0.1",
                "10.0.0.7:9004",
                "*.example.com:9005",
                "127.0.0.1:3128",
            ]
            .map(|e| AllowEntry::parse(e).unwrap()),
        );
        assert_eq!(
            l.forwards(),
            [
                "127.0.0.1:9000",
                "[::1]:9001",
                "localhost:9002",
                "127.0.0.2:9003"
            ]
        );
        // Every entry given is allowed too, forwarded or not.
        assert_eq!(l.check("[::1]", 9000), Verdict::Allowed { explicit: true });
        assert_eq!(
            l.check("10.0.0.7", 9004),
            Verdict::Allowed { explicit: true }
        );
        assert_eq!(
            l.check("api.anthropic.com", 443),
            Verdict::Allowed { explicit: true }
        );
        // Entries added as plain entries forward nothing.
        let mut team = AllowList::default();
        team.extend([AllowEntry::parse("127.0.0.1:9000").unwrap()]);
        assert!(team.forwards().is_empty());
        assert_eq!(
            team.check("127.0.0.1", 9000),
            Verdict::Allowed { explicit: true }
        );
    }

    #[test]
    fn a_teams_entries_allow_but_never_open_the_servers_loopback() {
        let mut l = list(&["127.0.0.1:9000", "api.example.com"]);
        l.extend_team(
            ["127.0.0.1:9100", "localhost:9200", "pypi.org"].map(|e| AllowEntry::parse(e).unwrap()),
        );
        assert_eq!(
            l.check("127.0.0.1", 9100),
            Verdict::Allowed { explicit: true }
        );
        assert!(l.opens_loopback("127.0.0.1", 9000));
        assert!(!l.opens_loopback("127.0.0.1", 9100));
        assert!(!l.opens_loopback("localhost", 9200));
        assert!(l.forwards().is_empty());
        for e in [
            "127.0.0.1:1",
            "[::1]",
            "0.0.0.0:5432",
            "localhost",
            "db.localhost:5432",
            "[::ffff:127.0.0.1]:1",
        ] {
            assert!(AllowEntry::parse(e).unwrap().names_loopback(), "{e}");
        }
        for e in ["10.0.0.7", "example.com", "*", "*.example.com"] {
            assert!(!AllowEntry::parse(e).unwrap().names_loopback(), "{e}");
        }
    }

    #[test]
    fn bad_entries_are_refused_with_a_reason() {
        for bad in [
            "",
            "*.com",
            "a*.example.com",
            "*.*.example.com",
            "exa mple.com",
            "example.com:0",
            "example.com:70000",
            "example.com:",
            "[::1",
            "[nope]:80",
            "-bad.example.com",
            "http://example.com",
            "example.com/path",
        ] {
            assert!(AllowEntry::parse(bad).is_err(), "{bad:?} was accepted");
        }
        assert!(AllowEntry::parse(&"a".repeat(300)).is_err());
    }

    #[test]
    fn entries_print_as_they_parse() {
        for e in [
            "api.openai.com",
            "*.example.com:8443",
            "*",
            "10.0.0.7:80",
            "[fd00::7]:443",
        ] {
            assert_eq!(AllowEntry::parse(e).unwrap().to_string(), e);
        }
    }
}
