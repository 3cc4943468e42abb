//! A cluster node's address as `--cluster-nodes` gives it: a host (a name or an IP address)
//! and a port. A name is looked up each time the node is dialled, not once at the start: in
//! Kubernetes a StatefulSet pod's name resolves only once the pod runs, and to a new address
//! when it is rescheduled.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

/// `HOST:PORT`, with an IPv6 address in brackets (`[::1]:25701`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerAddr {
    host: String,
    port: u16,
}

impl PeerAddr {
    /// `None` unless `text` is `HOST:PORT` with a port above 0 and a host without spaces.
    pub fn parse(text: &str) -> Option<PeerAddr> {
        let text = text.trim();
        if let Ok(addr) = text.parse::<SocketAddr>() {
            return (addr.port() != 0).then(|| PeerAddr::from(addr));
        }
        let (host, port) = text.rsplit_once(':')?;
        let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
        let plain = !host.is_empty()
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_');
        plain.then(|| PeerAddr {
            host: host.to_owned(),
            port,
        })
    }

    /// The host as given (a name, or an IP address without brackets).
    pub fn host(&self) -> &str {
        &self.host
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The address itself when the host is an IP address.
    pub fn literal(&self) -> Option<SocketAddr> {
        self.host
            .parse::<IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, self.port))
    }

    /// Looks the host up now (an IP address is its own answer): the first address found.
    pub async fn resolve(&self) -> std::io::Result<SocketAddr> {
        if let Some(addr) = self.literal() {
            return Ok(addr);
        }
        tokio::net::lookup_host((self.host.as_str(), self.port))
            .await?
            .next()
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{} has no address", self.host),
                )
            })
    }

    /// As [`PeerAddr::resolve`], blocking (for the start, before the runtime runs).
    pub fn resolve_now(&self) -> std::io::Result<SocketAddr> {
        use std::net::ToSocketAddrs;
        if let Some(addr) = self.literal() {
            return Ok(addr);
        }
        (self.host.as_str(), self.port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{} has no address", self.host),
                )
            })
    }
}

impl From<SocketAddr> for PeerAddr {
    fn from(addr: SocketAddr) -> Self {
        PeerAddr {
            host: addr.ip().to_string(),
            port: addr.port(),
        }
    }
}

impl fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_addresses_parse_and_print_back() {
        for text in [
            "127.0.0.1:25701",
            "[::1]:25702",
            "warren-0.warren.default.svc:25701",
            "node_3:1",
        ] {
            let addr = PeerAddr::parse(text).unwrap_or_else(|| panic!("{text}"));
            assert_eq!(addr.to_string(), text);
        }
        let v6 = PeerAddr::parse("[::1]:25702").expect("v6");
        assert_eq!(v6.host(), "::1");
        assert_eq!(v6.literal(), Some("[::1]:25702".parse().expect("addr")));
        assert_eq!(
            PeerAddr::parse("warren-0:25701").and_then(|a| a.literal()),
            None
        );
        for bad in [
            "",
            "host",
            "host:",
            ":25701",
            "host:0",
            "host:70000",
            "a b:1",
            "host:port",
        ] {
            assert_eq!(PeerAddr::parse(bad), None, "{bad:?}");
        }
    }

    #[tokio::test]
    async fn a_name_is_looked_up_when_asked() {
        let addr = PeerAddr::parse("localhost:25701").expect("addr");
        let found = addr.resolve().await.expect("localhost resolves");
        assert!(found.ip().is_loopback() && found.port() == 25701, "{found}");
        let nowhere = PeerAddr::parse("no-such-node.invalid:25701").expect("addr");
        assert!(nowhere.resolve().await.is_err());
    }
}
