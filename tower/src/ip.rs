//! Which client a request comes from, by IP address, without trusting
//! what the client wrote.
//!
//! The peer address comes from the connection (axum's `ConnectInfo`,
//! tonic's `TcpConnectInfo`, or a `SocketAddr` / `IpAddr` extension).
//! Forwarding headers are read only when the peer is a trusted proxy, and
//! then with the rightmost-untrusted rule: walking the hops from the
//! nearest, the first address that is not a trusted proxy is the client.
//! Everything left of it was written by the client and is ignored.
//! IPv6 clients are keyed per prefix (a /64 by default), since one host
//! usually holds a whole /64.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;

use http::{Extensions, HeaderMap};
use slicelimit::Error;

use crate::key::RequestView;

/// An IP network: an address and a prefix length, such as `10.0.0.0/8`.
///
/// IPv4-mapped IPv6 addresses (`::ffff:10.1.2.3`) are compared as IPv4.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// The network of `addr` with `prefix` leading bits; host bits are
    /// cleared.
    ///
    /// # Errors
    /// [`InvalidInput`](slicelimit::ErrorKind::InvalidInput) if `prefix` is
    /// longer than the address (32 bits for IPv4, 128 for IPv6).
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Cidr, Error> {
        let addr = addr.to_canonical();
        let bits = address_bits(addr);
        if prefix > bits {
            return Err(Error::invalid(format!(
                "prefix /{prefix} is longer than the {bits} bits of {addr}"
            )));
        }
        Ok(Cidr {
            network: mask(addr, prefix),
            prefix,
        })
    }

    /// Parses a comma-separated list such as `10.0.0.0/8, 2001:db8::/32`;
    /// an address without a prefix is a single host. An empty string is
    /// an empty list.
    ///
    /// # Errors
    /// [`InvalidInput`](slicelimit::ErrorKind::InvalidInput) naming the first
    /// entry that is not a network.
    pub fn parse_list(list: &str) -> Result<Vec<Cidr>, Error> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(Cidr::from_str)
            .collect()
    }

    /// Whether `ip` is in this network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        address_bits(ip) == address_bits(self.network) && mask(ip, self.prefix) == self.network
    }
}

impl FromStr for Cidr {
    type Err = Error;

    fn from_str(s: &str) -> Result<Cidr, Error> {
        let bad = || Error::invalid(format!("not an IP network: {s:?}"));
        let (addr, prefix) = match s.split_once('/') {
            Some((addr, prefix)) => (addr, Some(prefix.parse::<u8>().map_err(|_| bad())?)),
            None => (s, None),
        };
        let addr = addr.parse::<IpAddr>().map_err(|_| bad())?.to_canonical();
        Cidr::new(addr, prefix.unwrap_or(address_bits(addr)))
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

fn address_bits(ip: IpAddr) -> u8 {
    match ip {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

/// `ip` with every bit after the first `prefix` cleared.
fn mask(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let keep = u32::MAX
                .checked_shl(32 - u32::from(prefix.min(32)))
                .unwrap_or(0);
            IpAddr::V4(Ipv4Addr::from(u32::from(v4) & keep))
        }
        IpAddr::V6(v6) => {
            let keep = u128::MAX
                .checked_shl(128 - u32::from(prefix.min(128)))
                .unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(u128::from(v6) & keep))
        }
    }
}

/// The forwarding header a trusted proxy writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ProxyHeader {
    /// `X-Forwarded-For: client, proxy1, proxy2` (the default).
    #[default]
    XForwardedFor,
    /// RFC 7239 `Forwarded: for=client, for="[2001:db8::1]:4711"`.
    Forwarded,
}

impl ProxyHeader {
    fn name(self) -> &'static str {
        match self {
            ProxyHeader::XForwardedFor => "x-forwarded-for",
            ProxyHeader::Forwarded => "forwarded",
        }
    }
}

/// Whom the forwarding header is believed from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Trust {
    /// Nobody: the peer address is the client.
    Nobody,
    /// The peer and these networks are proxies (rightmost-untrusted).
    Proxies(Vec<Cidr>),
    /// This many proxies, whatever their addresses (weaker: the peer is
    /// not checked).
    Hops(usize),
}

/// How a request's client IP address is found and turned into a key.
///
/// ```
/// use slicelimit_tower::{Cidr, ClientIp, KeyExtractor, ProxyHeader};
///
/// # fn demo() -> Result<(), slicelimit::Error> {
/// // Behind a load balancer in 10.0.0.0/8 that appends to `Forwarded`:
/// let ip = ClientIp::behind(Cidr::parse_list("10.0.0.0/8")?)
///     .header(ProxyHeader::Forwarded)
///     .ipv6_prefix(56);
/// let key = KeyExtractor::ip(ip);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct ClientIp {
    trust: Trust,
    header: ProxyHeader,
    v4_prefix: u8,
    v6_prefix: u8,
}

impl ClientIp {
    /// The connection's peer address; forwarding headers are ignored.
    /// IPv6 clients are keyed per /64.
    pub fn peer() -> Self {
        ClientIp {
            trust: Trust::Nobody,
            header: ProxyHeader::default(),
            v4_prefix: 32,
            v6_prefix: 64,
        }
    }

    /// Behind proxies in `proxies`: when the peer is one of them, the
    /// forwarding header is read from the right, skipping every trusted
    /// address; the first untrusted one is the client. When the peer is
    /// not trusted, it is the client and the header is ignored. An empty
    /// list is [`peer`](ClientIp::peer).
    pub fn behind(proxies: impl IntoIterator<Item = Cidr>) -> Self {
        let proxies: Vec<Cidr> = proxies.into_iter().collect();
        let trust = if proxies.is_empty() {
            Trust::Nobody
        } else {
            Trust::Proxies(proxies)
        };
        ClientIp {
            trust,
            ..ClientIp::peer()
        }
    }

    /// Behind exactly `hops` proxies whose addresses are not known: the
    /// client is the `hops`-th address from the right of the forwarding
    /// header. 0 ignores the header. A header with fewer entries did not
    /// come through that many proxies, so the peer address is used.
    /// Prefer [`behind`](ClientIp::behind): this cannot check that the
    /// request came through a proxy at all.
    pub fn hops(hops: usize) -> Self {
        let trust = if hops == 0 {
            Trust::Nobody
        } else {
            Trust::Hops(hops)
        };
        ClientIp {
            trust,
            ..ClientIp::peer()
        }
    }

    /// Which forwarding header the proxies write (default
    /// `X-Forwarded-For`). Only that one is read: a header the proxies do
    /// not write is entirely the client's.
    pub fn header(mut self, header: ProxyHeader) -> Self {
        self.header = header;
        self
    }

    /// IPv6 clients are keyed by this many leading bits (default 64; at
    /// most 128, one key per address).
    pub fn ipv6_prefix(mut self, bits: u8) -> Self {
        self.v6_prefix = bits.min(128);
        self
    }

    /// IPv4 clients are keyed by this many leading bits (default 32, one
    /// key per address).
    pub fn ipv4_prefix(mut self, bits: u8) -> Self {
        self.v4_prefix = bits.min(32);
        self
    }

    /// The client's address (IPv4-mapped IPv6 folded to IPv4), or `None`
    /// without a peer address or when a trusted proxy recorded a hop it
    /// would not name (`unknown`, an obfuscated identifier, garbage).
    pub fn resolve(&self, request: &RequestView<'_>) -> Option<IpAddr> {
        let peer = peer_ip(request.extensions)?;
        let client = match &self.trust {
            Trust::Nobody => peer,
            Trust::Proxies(proxies) => {
                let trusted = |ip: IpAddr| proxies.iter().any(|c| c.contains(ip));
                if !trusted(peer) {
                    return Some(peer);
                }
                let mut client = peer;
                for hop in hops(request.headers, self.header).into_iter().rev() {
                    client = hop?;
                    if !trusted(client) {
                        break;
                    }
                }
                client
            }
            Trust::Hops(n) => {
                let hops = hops(request.headers, self.header);
                match hops.len().checked_sub(*n) {
                    Some(index) => hops[index]?,
                    None => peer,
                }
            }
        };
        Some(client.to_canonical())
    }

    /// The rate-limit key: the address, or its network (`2001:db8:1:2::/64`)
    /// when the prefix is shorter than the address.
    pub fn key(&self, request: &RequestView<'_>) -> Option<String> {
        let ip = self.resolve(request)?;
        let prefix = match ip {
            IpAddr::V4(_) => self.v4_prefix,
            IpAddr::V6(_) => self.v6_prefix,
        };
        Some(if prefix >= address_bits(ip) {
            ip.to_string()
        } else {
            format!("{}/{prefix}", mask(ip, prefix))
        })
    }
}

/// The connection's peer address, from whichever server put it there.
pub(crate) fn peer_ip(extensions: &Extensions) -> Option<IpAddr> {
    #[cfg(feature = "axum")]
    if let Some(info) = extensions.get::<axum::extract::ConnectInfo<SocketAddr>>() {
        return Some(info.0.ip());
    }
    #[cfg(feature = "tonic")]
    if let Some(addr) = extensions
        .get::<tonic::transport::server::TcpConnectInfo>()
        .and_then(|info| info.remote_addr())
    {
        return Some(addr.ip());
    }
    extensions
        .get::<SocketAddr>()
        .map(SocketAddr::ip)
        .or_else(|| extensions.get::<IpAddr>().copied())
}

/// The hops a forwarding header lists, leftmost (furthest) first; `None`
/// for a hop that names no address.
///
/// Each header line is split from its right end, where the proxies write:
/// a proxy may append its hop to the line the client sent (RFC 9110 §5.3
/// makes that the same as a line of its own), so whatever the client put
/// to the left (an unterminated quote, bytes that are not text) must not
/// change how the proxies' hops to its right are read. `X-Forwarded-For`
/// has no quoting at all: only `Forwarded` splits around quoted strings.
fn hops(headers: &HeaderMap, header: ProxyHeader) -> Vec<Option<IpAddr>> {
    let mut out = Vec::new();
    let quoted = header == ProxyHeader::Forwarded;
    for value in headers.get_all(header.name()) {
        for element in split_from_right(value.as_bytes(), b',', quoted) {
            let node = std::str::from_utf8(element)
                .ok()
                .and_then(|e| match header {
                    ProxyHeader::XForwardedFor => Some(e.trim()),
                    ProxyHeader::Forwarded => forwarded_for(e),
                });
            out.push(node.and_then(node_ip));
        }
    }
    out
}

/// The `for=` value of one RFC 7239 forwarded-element; `None` when it
/// names `for` twice (RFC 7239 §4 forbids it, and which one a proxy wrote
/// depends on where it put the text it copied from the client).
fn forwarded_for(element: &str) -> Option<&str> {
    let mut found = None;
    for pair in split_from_right(element.as_bytes(), b';', true) {
        let Some((name, value)) = std::str::from_utf8(pair)
            .ok()
            .and_then(|p| p.split_once('='))
        else {
            continue;
        };
        if name.trim().eq_ignore_ascii_case("for") {
            if found.is_some() {
                return None;
            }
            found = Some(value.trim());
        }
    }
    found
}

/// Splits `s` on `sep`, scanning from the right; with `quoted`, not
/// inside double-quoted strings (a quote preceded by an odd run of
/// backslashes is escaped). Pieces come back left to right. Scanning from
/// the right means text to the left of a piece never changes that piece:
/// an unbalanced quote only swallows what lies to its left.
fn split_from_right(s: &[u8], sep: u8, quoted: bool) -> Vec<&[u8]> {
    let mut pieces = Vec::new();
    let mut inside = false;
    let mut end = s.len();
    for i in (0..s.len()).rev() {
        let c = s[i];
        if quoted && c == b'"' {
            let backslashes = s[..i].iter().rev().take_while(|&&b| b == b'\\').count();
            if backslashes % 2 == 0 {
                inside = !inside;
            }
        } else if c == sep && !inside {
            pieces.push(&s[i + 1..end]);
            end = i;
        }
    }
    pieces.push(&s[..end]);
    pieces.reverse();
    pieces
}

/// An address from a node: `192.0.2.1`, `192.0.2.1:80`, `2001:db8::1`,
/// `[2001:db8::1]:80`, any of them quoted.
fn node_ip(node: &str) -> Option<IpAddr> {
    let node = node.trim().trim_matches('"');
    if let Ok(ip) = node.parse::<IpAddr>() {
        return Some(ip);
    }
    if let Some(rest) = node.strip_prefix('[') {
        let (inside, _) = rest.split_once(']')?;
        return inside.parse::<Ipv6Addr>().ok().map(IpAddr::V6);
    }
    node.parse::<SocketAddr>().ok().map(|a| a.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn networks_parse_mask_and_fold_mapped_addresses() {
        let nets = Cidr::parse_list("10.0.0.0/8, 2001:db8::/32 ,192.0.2.7").unwrap();
        assert_eq!(nets.len(), 3);
        assert!(nets[0].contains("10.200.1.1".parse().unwrap()));
        assert!(nets[0].contains("::ffff:10.1.2.3".parse().unwrap()));
        assert!(!nets[0].contains("11.0.0.1".parse().unwrap()));
        assert!(nets[1].contains("2001:db8:ffff::1".parse().unwrap()));
        assert!(nets[2].contains("192.0.2.7".parse().unwrap()));
        assert!(!nets[2].contains("192.0.2.8".parse().unwrap()));
        assert_eq!(
            "10.9.9.9/8".parse::<Cidr>().unwrap().to_string(),
            "10.0.0.0/8"
        );
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
        assert!("example.com".parse::<Cidr>().is_err());
        assert!("0.0.0.0/0"
            .parse::<Cidr>()
            .unwrap()
            .contains("8.8.8.8".parse().unwrap()));
    }

    #[test]
    fn a_client_prefix_cannot_change_the_hops_a_proxy_appended() {
        // The client leaves a quote open; the proxy appends its hop to the
        // same line. The proxy's hop is still read as written.
        let mut headers = HeaderMap::new();
        headers.append(
            "forwarded",
            "for=203.0.113.9;x=\", for=198.51.100.8".parse().unwrap(),
        );
        let read = hops(&headers, ProxyHeader::Forwarded);
        assert_eq!(read.last(), Some(&Some("198.51.100.8".parse().unwrap())));
        // `for` twice in one element: neither is believed.
        let mut headers = HeaderMap::new();
        headers.append(
            "forwarded",
            "host=x;for=6.6.6.6;for=203.0.113.5".parse().unwrap(),
        );
        assert_eq!(hops(&headers, ProxyHeader::Forwarded), [None]);
        // X-Forwarded-For has no quoting; bytes that are not text spoil
        // only their own entry.
        let mut headers = HeaderMap::new();
        headers.append(
            "x-forwarded-for",
            http::HeaderValue::from_bytes(b"\"1.2.3.4, \xff\xfe, 198.51.100.8").unwrap(),
        );
        let read = hops(&headers, ProxyHeader::XForwardedFor);
        assert_eq!(
            read,
            [
                Some("1.2.3.4".parse().unwrap()),
                None,
                Some("198.51.100.8".parse().unwrap())
            ]
        );
    }

    #[test]
    fn forwarded_nodes_in_every_form() {
        let mut headers = HeaderMap::new();
        headers.append(
            "forwarded",
            "for=192.0.2.60;proto=http, For=\"[2001:db8:cafe::17]:4711\""
                .parse()
                .unwrap(),
        );
        headers.append("forwarded", "for=unknown, by=10.0.0.1".parse().unwrap());
        headers.append("forwarded", "for=\"198.51.100.1:80\"".parse().unwrap());
        let hops = hops(&headers, ProxyHeader::Forwarded);
        assert_eq!(
            hops,
            [
                Some("192.0.2.60".parse().unwrap()),
                Some("2001:db8:cafe::17".parse().unwrap()),
                None,
                None,
                Some("198.51.100.1".parse().unwrap()),
            ]
        );
    }
}
