//! Reading a `shallot.toml`: its client keys, routes, grants and filters.

use super::Config;

fn read_keys(file: &std::path::Path) -> Result<Vec<super::ClientKey>, super::LoadError> {
    Config::read(file)?.keys()
}

#[test]
fn client_keys_come_hashed_or_from_the_environment_and_nothing_else() {
    let dir = std::env::temp_dir().join(format!("shallot-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    let write = |text: &str| std::fs::write(&file, text).unwrap();
    // SAFETY: no other test reads or writes this variable.
    unsafe { std::env::set_var("SHALLOT_TEST_OPS_KEY", "sk-ops") };
    write(concat!(
        "[[key]]\nname = \"billing\"\ntenant = \"acme\"\n",
        "sha256 = \"a926675e5e28bc4294606f8631824dd0a5c8cb3a1bc7c1ca29b0e232b92b2d95\"\n",
        "[[key]]\nname = \"ops\"\nenv = \"SHALLOT_TEST_OPS_KEY\"\nmodels = [\"raw\"]\n",
    ));
    let keys = read_keys(&file).unwrap();
    assert_eq!(keys[0].tenant.as_deref(), Some("acme"));
    assert!(keys[0].may_use("raw") && keys[0].may_use("filtered"));
    assert!(keys[1].may_use("raw") && !keys[1].may_use("filtered"));
    assert!(keys[0].matches("shallot-test-key") && !keys[0].matches("sk-ops"));
    assert!(keys[1].matches("sk-ops"));
    assert!(
        !format!("{keys:?}").contains("a92667"),
        "Debug shows no digest"
    );
    for (text, says) in [
        ("[[key]]\nname = \"x\"\nsha256 = \"abc\"\n", "64 hex digits"),
        ("[[key]]\nname = \"x\"\n", "exactly one of"),
        (
            "[[key]]\nname = \"x\"\nenv = \"SHALLOT_TEST_OPS_KEY\"\nmodels = []\n",
            "could use nothing",
        ),
        (
            "[[key]]\nname = \"x\"\nenv = \"SHALLOT_TEST_UNSET_KEY\"\n",
            "is not set",
        ),
        (
            "[[key]]\nname = \"x\"\nsecret = \"plain\"\n",
            "unknown field",
        ),
        (
            "[[key]]\nname = \"a/b\"\nenv = \"SHALLOT_TEST_OPS_KEY\"\n",
            "cannot hold '/'",
        ),
        (
            concat!(
                "[[key]]\nname = \"x\"\ntenant = \"acme\"\nenv = \"SHALLOT_TEST_OPS_KEY\"\n",
                "[[key]]\nname = \"acme\"\nenv = \"SHALLOT_TEST_OPS_KEY\"\n",
            ),
            "would share conversations",
        ),
    ] {
        write(text);
        let error = read_keys(&file).unwrap_err().to_string();
        assert!(error.contains(says), "{error}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_broken_config_is_placed_by_line_and_column_without_quoting_its_lines() {
    let dir = std::env::temp_dir().join(format!("shallot-broken-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    std::fs::write(
        &file,
        "[model]\nbase_url = \"http://localhost:8000/v1\"\napi_key = \"sk-live-secret\nmodel = \"x\"\n",
    )
    .unwrap();
    let error = Config::read(&file).unwrap_err().to_string();
    assert!(error.contains("line 3, column "), "{error}");
    assert!(!error.contains("sk-live"), "the key is not quoted: {error}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_kv_grant_is_a_store_or_a_table_its_sqlite_path_relative_to_the_config() {
    use crate::store::StoreSpec;
    let dir = std::env::temp_dir().join(format!("shallot-kv-grant-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    let filters = |grant: &str| {
        let text = format!("[[filter]]\nplugin = \"x.wasm\"\ngrants = {{ kv = {grant} }}\n");
        std::fs::write(&file, text).unwrap();
        super::read_config(&file)
    };
    let read = filters("\"limits.db\"").unwrap();
    let kv = read[0].1.grants.kv.clone().unwrap();
    assert_eq!(kv.store, StoreSpec::Sqlite(dir.join("limits.db")));
    assert_eq!(kv.namespace, None);
    let read = filters("{ store = \"redis://127.0.0.1/0\", namespace = \"limits\" }").unwrap();
    let kv = read[0].1.grants.kv.clone().unwrap();
    assert_eq!(kv.store, StoreSpec::Redis("redis://127.0.0.1/0".into()));
    assert_eq!(kv.namespace.as_deref(), Some("limits"));
    for wrong in ["5", "{ store = \":memory:\", name = \"x\" }"] {
        let error = filters(wrong).unwrap_err().to_string();
        assert!(error.contains("a store (a SQLite file's path"), "{error}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_http_grant_is_a_list_of_origins_or_a_table_of_them_and_its_bounds() {
    use crate::plugin::HttpGrant;
    let dir = std::env::temp_dir().join(format!("shallot-http-grant-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    let filters = |grant: &str| {
        let text = format!("[[filter]]\nplugin = \"x.wasm\"\ngrants = {{ http = {grant} }}\n");
        std::fs::write(&file, text).unwrap();
        super::read_config(&file)
    };
    let read = filters("[\"https://api.example.com\"]").unwrap();
    let http = read[0].1.grants.http.clone().unwrap();
    assert_eq!(http.origins[0].to_string(), "https://api.example.com:443");
    assert_eq!(http.requests, HttpGrant::REQUESTS);
    let table = "{ origins = [\"http://127.0.0.1:9000\"], private = [\"http://moderation.internal:8080\"], requests = 2, timeout_ms = 900 }";
    let http = filters(table).unwrap()[0].1.grants.http.clone().unwrap();
    assert_eq!((http.requests, http.timeout_ms), (2, 900));
    assert_eq!(http.private[0].host, "moderation.internal");
    assert_eq!(http.send_bytes, HttpGrant::SEND_BYTES);
    for (wrong, says) in [
        ("[\"ftp://x\"]", "the scheme `ftp` is not http or https"),
        (
            "{ origins = [\"https://x/path\"] }",
            "an origin has no path",
        ),
        ("{ origins = [], proxy = \"x\" }", "unknown field `proxy`"),
        ("\"https://x\"", "a list of origins"),
    ] {
        let error = filters(wrong).unwrap_err().to_string();
        assert!(error.contains(says), "{wrong}: {error}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

use super::expand;

#[test]
fn plugin_dirs_take_environment_variables_with_defaults() {
    assert_eq!(
        expand("${SHALLOT_TEST_UNSET:-../target}/guest").unwrap(),
        std::path::Path::new("../target/guest")
    );
    assert_eq!(
        expand("plain/dir").unwrap(),
        std::path::Path::new("plain/dir")
    );
    let home = std::env::var("HOME").unwrap();
    assert_eq!(
        expand("${HOME:-x}/guest").unwrap(),
        std::path::Path::new(&home).join("guest")
    );
    assert!(
        expand("${SHALLOT_TEST_UNSET}/x")
            .unwrap_err()
            .contains("is not set")
    );
    assert!(expand("${OPEN").is_err());
}

#[test]
fn mcp_servers_take_the_environment_and_a_relative_command_from_the_file() {
    let dir = std::env::temp_dir().join(format!("shallot-mcp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    // SAFETY: no other test reads or writes this variable.
    unsafe { std::env::set_var("SHALLOT_TEST_MCP_TOKEN", "t-1") };
    let text = concat!(
        "[[mcp]]\nname = \"files\"\ncommand = \"servers/files.sh\"\n",
        "args = [\"--token\", \"${SHALLOT_TEST_MCP_TOKEN}\"]\n",
        "env = { TOKEN = \"${SHALLOT_TEST_MCP_TOKEN}\", MODE = \"${SHALLOT_TEST_MCP_MODE:-ro}\" }\n",
        "[[mcp]]\nname = \"web\"\ncommand = \"python3\"\nprefix = \"w_\"\ntimeout_ms = 500\n",
        "[[mcp]]\nname = \"remote\"\nurl = \"https://mcp.example/${SHALLOT_TEST_MCP_TOKEN}\"\n",
        "headers = { Authorization = \"Bearer ${SHALLOT_TEST_MCP_TOKEN}\" }\n",
    );
    std::fs::write(&file, text).unwrap();
    let servers = Config::read(&file).unwrap().mcp().unwrap();
    let files = dir.join("servers/files.sh");
    assert_eq!(servers[0].command.as_deref(), files.to_str());
    assert_eq!(servers[0].args, ["--token", "t-1"]);
    assert_eq!(
        (&servers[0].env["TOKEN"], &servers[0].env["MODE"]),
        (&"t-1".to_owned(), &"ro".to_owned())
    );
    assert_eq!(
        (servers[0].timeout_ms, servers[0].max_message_kib),
        (30_000, 4096)
    );
    assert_eq!(
        (
            servers[1].command.as_deref(),
            servers[1].prefix.as_deref(),
            servers[1].timeout_ms
        ),
        (Some("python3"), Some("w_"), 500)
    );
    assert_eq!(
        (
            servers[2].url.as_deref(),
            servers[2].headers["Authorization"].as_str()
        ),
        (Some("https://mcp.example/t-1"), "Bearer t-1")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_mcp_server_named_twice_unset_or_with_both_transports_is_refused_saying_why() {
    let dir = std::env::temp_dir().join(format!("shallot-mcp-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    for (text, says) in [
        (
            "[[mcp]]\nname = \"a\"\ncommand = \"x\"\n[[mcp]]\nname = \"a\"\ncommand = \"y\"\n",
            "[[mcp]] 'a': name: two servers have it",
        ),
        (
            "[[mcp]]\nname = \"a\"\ncommand = \"${SHALLOT_TEST_MCP_UNSET}\"\n",
            "[[mcp]] 'a': command",
        ),
        (
            "[[mcp]]\nname = \"a\"\ncommand = \"x\"\nurl = \"http://x\"\n",
            "give one of `command` and `url`",
        ),
        ("[[mcp]]\nname = \"a\"\n", "give one of `command` and `url`"),
        (
            "[[mcp]]\nname = \"a\"\ncommand = \"x\"\nport = 1\n",
            "unknown field `port`",
        ),
    ] {
        std::fs::write(&file, text).unwrap();
        let error = Config::read(&file)
            .and_then(|c| c.mcp())
            .unwrap_err()
            .to_string();
        assert!(error.contains(says), "{text}: {error}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_mcp_gateway_table_needs_servers_and_keys_name_their_tools_as_patterns() {
    let dir = std::env::temp_dir().join(format!("shallot-mcp-gateway-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    let text = concat!(
        "[[mcp]]\nname = \"files\"\ncommand = \"x\"\n",
        "[mcp_gateway]\nfilters = [\"guard\"]\n",
        "[[key]]\nname = \"reader\"\ntools = [\"files_read*\", \"*_list\", \"exact\"]\n",
        "sha256 = \"a926675e5e28bc4294606f8631824dd0a5c8cb3a1bc7c1ca29b0e232b92b2d95\"\n",
        "[[key]]\nname = \"ops\"\n",
        "sha256 = \"a926675e5e28bc4294606f8631824dd0a5c8cb3a1bc7c1ca29b0e232b92b2d95\"\n",
    );
    std::fs::write(&file, text).unwrap();
    let config = Config::read(&file).unwrap();
    let spec = config.mcp_gateway().unwrap().unwrap();
    assert_eq!(spec.filters.as_deref(), Some(&["guard".to_owned()][..]));
    assert_eq!(spec.allowed_hosts, ["localhost", "127.0.0.1", "::1"]);
    assert_eq!(spec.max_sessions, 4096);
    let keys = config.keys().unwrap();
    for (tool, may) in [
        ("files_read", true),
        ("files_read_dir", true),
        ("files_list", true),
        ("exact", true),
        ("files_write", false),
        ("exactly", false),
        ("xfiles_read", false),
        ("files.read", false),
    ] {
        assert_eq!(keys[0].may_call(tool), may, "{tool}");
        assert!(keys[1].may_call(tool), "no `tools`: every tool");
    }
    for (text, says) in [
        ("[mcp_gateway]\n", "there are no [[mcp]] servers"),
        (
            "[[mcp]]\nname = \"a\"\ncommand = \"x\"\n[mcp_gateway]\nport = 1\n",
            "unknown field `port`",
        ),
    ] {
        std::fs::write(&file, text).unwrap();
        let error = Config::read(&file)
            .and_then(|c| c.mcp_gateway())
            .unwrap_err()
            .to_string();
        assert!(error.contains(says), "{text}: {error}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_model_table_names_a_server_of_either_api_as_an_upstream_table_does() {
    use crate::model::{AnthropicConfig, OpenAiConfig, Server};
    let dir = std::env::temp_dir().join(format!("shallot-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("shallot.toml");
    let model = |text: &str| {
        std::fs::write(&file, text).unwrap();
        Config::read(&file)?.model()
    };
    let anthropic = model(concat!(
        "[model]\napi = \"anthropic\"\nbase_url = \"http://127.0.0.1:9/v1\"\n",
        "model = \"claude\"\napi_key = \"k\"\nmax_tokens = 64\n",
    ))
    .unwrap();
    let mut expected = AnthropicConfig::new("http://127.0.0.1:9/v1", "claude");
    expected.api_key = Some("k".to_owned());
    expected.max_tokens = 64;
    assert_eq!(anthropic, Some(Server::Anthropic(expected)));
    let openai =
        model("[model]\nbase_url = \"http://127.0.0.1:9/v1\"\nmodel = \"m\"\napi_key = \"k\"\n");
    let mut expected = OpenAiConfig::new("http://127.0.0.1:9/v1", "m");
    expected.api_key = Some("k".to_owned());
    assert_eq!(openai.unwrap(), Some(Server::OpenAi(expected)));
    for (table, says) in [
        ("weight = 2\n", "`name` and `weight` go with `upstreams`"),
        (
            "max_tokens = 9\n",
            "`max_tokens` is for `api = \"anthropic\"`",
        ),
    ] {
        let text = format!("[model]\nbase_url = \"http://h/v1\"\nmodel = \"m\"\n{table}");
        let error = model(&text).unwrap_err().to_string();
        assert!(error.contains("[model]") && error.contains(says), "{error}");
    }
    assert_eq!(model("").unwrap(), None);
    std::fs::remove_dir_all(&dir).unwrap();
}
