//! Which addresses an outgoing request may connect to.

use std::net::IpAddr;

use crate::plugin::HttpOrigin;

/// Whether a request to `origin` may connect to `ip`: the address an
/// origin names, the loopback addresses for `localhost`, any address for
/// an origin listed as private, else only a public one.
pub(super) fn reachable(origin: &HttpOrigin, private: bool, ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    if let Some(named) = origin.address() {
        return ip == named.to_canonical();
    }
    if origin.is_localhost() {
        return ip.is_loopback();
    }
    private || public(ip)
}

/// Whether `ip` is a public unicast address: not loopback, link-local,
/// private, shared (carrier NAT), unspecified, multicast, broadcast or
/// documentation, nor an IPv6 address embedding one (mapped, NAT64, 6to4).
fn public(ip: IpAddr) -> bool {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (b & 0xc0) == 64)
                || (a == 192 && b == 0 && c == 0)
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            let embedded = |hi: u16, lo: u16| {
                IpAddr::from([(hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8])
            };
            if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                return public(embedded(s[6], s[7]));
            }
            if s[0] == 0x2002 {
                return public(embedded(s[1], s[2]));
            }
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || v6.is_unique_local()
                || v6.is_unicast_link_local()
                || (s[0] == 0x2001 && s[1] == 0xdb8))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin(text: &str) -> HttpOrigin {
        HttpOrigin::try_from(text.to_owned()).unwrap()
    }

    #[test]
    fn only_public_addresses_are_reached_through_a_name() {
        let named = origin("https://api.example.com");
        for private in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
            "64:ff9b::a00:1",
            "2002:7f00:1::",
            "255.255.255.255",
            "224.0.0.1",
        ] {
            let ip: IpAddr = private.parse().unwrap();
            assert!(!reachable(&named, false, ip), "{private}");
            assert!(reachable(&named, true, ip), "{private} (listed as private)");
        }
        for public in ["93.184.216.34", "2606:4700::1111", "64:ff9b::5db8:d822"] {
            assert!(
                reachable(&named, false, public.parse().unwrap()),
                "{public}"
            );
        }
    }

    #[test]
    fn an_origin_that_names_an_address_reaches_that_address_only() {
        let loopback = origin("http://127.0.0.1:9000");
        assert!(reachable(&loopback, false, "127.0.0.1".parse().unwrap()));
        assert!(!reachable(&loopback, false, "127.0.0.2".parse().unwrap()));
        let localhost = origin("http://localhost:9000");
        assert!(reachable(&localhost, false, "::1".parse().unwrap()));
        assert!(!reachable(&localhost, false, "10.0.0.1".parse().unwrap()));
        assert!(reachable(
            &origin("http://[::1]:80"),
            false,
            "::1".parse().unwrap()
        ));
    }

    #[test]
    fn origins_are_scheme_host_and_port() {
        assert_eq!(
            origin("https://API.example.com").to_string(),
            "https://api.example.com:443"
        );
        assert_eq!(origin("http://[::1]").to_string(), "http://[::1]:80");
        assert_eq!(origin("http://a.b:8080/"), origin("http://a.b:8080"));
        for bad in [
            "ftp://a.b",
            "a.b",
            "https://u@a.b",
            "https://a.b/path",
            "https://",
        ] {
            assert!(HttpOrigin::try_from(bad.to_owned()).is_err(), "{bad}");
        }
    }
}
