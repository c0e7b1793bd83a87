use super::*;

const EXAMPLE: &str = r#"
domain: api
descriptors:
  - key: api_key
    rate_limit: { unit: minute, requests_per_unit: 100 }
    descriptors:
      - key: path
        value: /upload
        name: uploads
        rate_limit: { unit: hour, requests_per_unit: 10 }
  - key: remote_address
    value: "10.0.*"
    unlimited: true
  - key: remote_address
    value: "10.*"
    shadow_mode: true
    slicelimit: { algorithm: token_bucket }
    rate_limit: { unit: second, requests_per_unit: 5 }
  - key: remote_address
    value: 10.9.9.9
    rate_limit: { unit: Day, requests_per_unit: 1 }
  - key: remote_address
    rate_limit: { unit: second, requests_per_unit: 50 }
"#;

fn example() -> Config {
    Config::parse("example.yaml", EXAMPLE).expect("the example parses")
}

fn path<'a>(config: &'a Config, entries: &[(&str, &str)]) -> Option<&'a str> {
    config.rule(entries).map(|r| r.path.as_str())
}

#[test]
fn a_descriptor_reaches_the_rule_of_the_node_its_last_entry_reaches() {
    let config = example();
    assert_eq!(config.domain(), "api");
    let key = config.rule(&[("api_key", "k1")]).expect("a rule");
    assert_eq!(key.path, "api_key");
    assert_eq!(
        key.quota,
        Some(Quota::new(100, Duration::from_secs(60)).unwrap())
    );
    assert_eq!(key.algorithm, Algorithm::FixedWindow);
    let upload = config
        .rule(&[("api_key", "k1"), ("path", "/upload")])
        .expect("a rule");
    assert_eq!(upload.path, "api_key/path=%2Fupload");
    assert_eq!(upload.name.as_deref(), Some("uploads"));
    assert_eq!(upload.quota.unwrap().period(), Duration::from_secs(3_600));
    // No node for the entry, or no entries: no rule, nothing counted.
    assert_eq!(
        path(&config, &[("api_key", "k1"), ("path", "/other")]),
        None
    );
    assert_eq!(path(&config, &[("user", "u")]), None);
    assert_eq!(path(&config, &[]), None);
}

#[test]
fn an_exact_value_beats_the_first_wildcard_which_beats_the_key_alone() {
    let config = example();
    assert_eq!(
        path(&config, &[("remote_address", "10.9.9.9")]),
        Some("remote_address=10.9.9.9")
    );
    let unlimited = config.rule(&[("remote_address", "10.0.3.4")]).unwrap();
    assert_eq!(unlimited.path, "remote_address=10.0.*");
    assert_eq!(unlimited.quota, None);
    let shadow = config.rule(&[("remote_address", "10.1.2.3")]).unwrap();
    assert_eq!(shadow.path, "remote_address=10.*");
    assert!(shadow.shadow_mode);
    assert_eq!(shadow.algorithm, Algorithm::TokenBucket);
    assert_eq!(
        path(&config, &[("remote_address", "192.0.2.1")]),
        Some("remote_address")
    );
}

#[test]
fn every_rule_is_listed_once_in_file_order() {
    let paths: Vec<String> = example().rules().iter().map(|r| r.path.clone()).collect();
    assert_eq!(
        paths,
        [
            "api_key",
            "api_key/path=%2Fupload",
            "remote_address=10.0.*",
            "remote_address=10.*",
            "remote_address=10.9.9.9",
            "remote_address",
        ]
    );
}

/// The error for `text`, which must name every one of `words`.
fn refused(text: &str, words: &[&str]) {
    let err = Config::parse("limits/api.yaml", text).expect_err("refused");
    let message = err.to_string();
    assert!(message.contains("limits/api.yaml"), "{message}");
    for word in words {
        assert!(message.contains(word), "{word:?} missing from: {message}");
    }
}

#[test]
fn what_cannot_be_honoured_is_refused_naming_file_descriptor_and_field() {
    refused(
        "domain: d\ndescriptors:\n  - key: a\n    replaces: [{name: x}]\n",
        &["#1", "replaces"],
    );
    refused(
        "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        rate_limit: {unit: fortnight, requests_per_unit: 3}\n",
        &["a/b", "unit", "fortnight", "week"],
    );
    refused(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, unit: day, requests_per_unit: 25}\n",
        &["a", "unlimited", "unit"],
    );
    refused(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: -1}\n",
        &["a", "requests_per_unit"],
    );
    refused(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1, burst: 3}\n",
        &["a", "burst"],
    );
    refused(
        "domain: d\ndescriptors:\n  - key: a\n    unlimited: true\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        &["a", "unlimited"],
    );
    refused(
        "domain: d\ndescriptors:\n  - key: a\n    shadow_mode: true\n",
        &["a", "shadow_mode"],
    );
    refused(
        "domain: d\ndescriptors:\n  - key: a\n    value: v\n  - key: a\n    value: v\n",
        &["#2", "a=v", "twice"],
    );
    refused(
        "domain: d\ndescriptors:\n  - key: a\n    slicelimit: {algorithm: leaky}\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        &["a", "algorithm", "leaky", "gcra"],
    );
    refused(
        "domain: d\ndescriptors:\n  - key: a\n    slicelimit: {post_hoc: true}\n",
        &["a", "post_hoc", "rule"],
    );
    refused(
        "domain: d\ndescriptors:\n  - key: a\n    slicelimit: {post_hoc: yes please}\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        &["a", "post_hoc", "true or false"],
    );
    refused(
        "domain: d\ndescriptors:\n  - key: a\n    slicelimit: {postHoc: true}\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
        &["a", "postHoc", "unsupported"],
    );
    refused("descriptors: []\n", &["domain"]);
    refused("domain: d\nrlqs_only: 1\n", &["rlqs_only"]);
    refused("domain: [unclosed\n", &["not YAML"]);
    refused("domain: d\ndescriptors:\n  - value: v\n", &["#1", "key"]);
}

#[test]
fn post_hoc_rules_are_read_with_their_algorithm() {
    let config = Config::parse(
        "llm.yaml",
        "domain: llm\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 1000}\n    slicelimit: {post_hoc: true, algorithm: token_bucket}\n  - key: other\n    rate_limit: {unit: minute, requests_per_unit: 1}\n",
    )
    .unwrap();
    let tenant = config.rule(&[("tenant", "acme")]).unwrap();
    assert!(tenant.post_hoc);
    assert_eq!(tenant.algorithm, slicelimit::Algorithm::TokenBucket);
    assert!(!config.rule(&[("other", "x")]).unwrap().post_hoc);
}

#[test]
fn a_domain_without_descriptors_has_no_rules() {
    let config = Config::parse("empty.yaml", "domain: quiet\n").unwrap();
    assert!(config.rules().is_empty());
    assert_eq!(config.rule(&[("a", "b")]), None);
}

#[test]
fn a_file_nested_absurdly_deep_is_refused_not_a_crash() {
    let mut text = String::from("domain: d\ndescriptors:\n");
    for depth in 0..5_000 {
        let pad = "  ".repeat(depth);
        text.push_str(&format!("{pad}- key: k{depth}\n{pad}  descriptors:\n"));
    }
    let err = Config::parse("deep.yaml", &text).expect_err("refused");
    assert!(err.to_string().contains("deep.yaml: not YAML"), "{err}");
}

#[test]
fn no_two_rules_share_a_path() {
    let text = r#"
domain: d
descriptors:
  - key: a
    value: "b/c=d"
    rate_limit: { unit: second, requests_per_unit: 1 }
  - key: a
    value: b
    descriptors:
      - key: c
        value: d
        rate_limit: { unit: second, requests_per_unit: 100 }
"#;
    let config = Config::parse("d.yaml", text).expect("parses");
    let paths: Vec<&str> = config.rules().iter().map(|r| r.path.as_str()).collect();
    assert_eq!(paths, ["a=b%2Fc%3Dd", "a=b/c=d"]);
    let flat = config.rule(&[("a", "b/c=d")]).unwrap();
    assert_eq!(flat.quota.unwrap().limit(), 1);
}

/// envoyproxy/ratelimit's `test/config/` fixtures (Apache License 2.0,
/// copyright the Envoy Project Authors; see `tests/reference/README.md`).
const REFERENCE_BASIC: &str = include_str!("../../tests/reference/basic_config.yaml");
const REFERENCE_SHARE_THRESHOLD: &str = include_str!("../../tests/reference/share_threshold.yaml");
const REFERENCE_METADATA: &str = include_str!("../../tests/reference/metadata.yaml");
const REFERENCE_REPLACES_SELF: &str = include_str!("../../tests/reference/replaces_self.yaml");
const REFERENCE_REPLACES_EMPTY: &str = include_str!("../../tests/reference/replaces_empty.yaml");

/// envoyproxy/ratelimit's `test/config/wildcard.yaml` (as above).
const REFERENCE_WILDCARD: &str = r#"
domain: test-domain
descriptors:
  - key: wild
    value: foo*
    rate_limit:
      unit: minute
      requests_per_unit: 20
  - key: noWild
    value: foo
    rate_limit:
      unit: minute
      requests_per_unit: 20
  - key: noVal
    rate_limit:
      unit: minute
      requests_per_unit: 20
  - key: midWild
    value: bar*b
    rate_limit:
      unit: minute
      requests_per_unit: 20
  - key: multiWild
    value: foo*bar*baz
    rate_limit:
      unit: minute
      requests_per_unit: 10
  - key: nestedWild
    value: val1
    descriptors:
      - key: wild
        value: goo*
        rate_limit:
          unit: minute
          requests_per_unit: 20
"#;

#[test]
fn the_reference_format_names_and_unlimited_rules_inside_rate_limit() {
    let config = Config::parse("basic_config.yaml", REFERENCE_BASIC).expect("parses");
    let key4 = config.rule(&[("key4", "x")]).unwrap();
    assert_eq!(key4.name.as_deref(), Some("key4_rate_limit"));
    assert_eq!(key4.quota.unwrap().period(), Duration::from_secs(86_400));
    let key6 = config.rule(&[("key6", "x")]).unwrap();
    assert_eq!(key6.quota, None, "unlimited");
    // A value with no rule of its own counts nothing (the reference's
    // allow-list idiom).
    assert!(config.rule(&[("key2", "value3")]).is_none());
    assert_eq!(
        config
            .rule(&[("key2", "other")])
            .unwrap()
            .quota
            .unwrap()
            .limit(),
        20
    );
    assert_eq!(
        config
            .rule(&[("key1", "value1"), ("subkey1", "subvalue1")])
            .unwrap()
            .quota
            .unwrap()
            .limit(),
        10
    );
}

#[test]
fn every_unit_the_reference_knows_is_honoured() {
    for (unit, secs) in UNITS {
        let text = format!(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {{unit: {}, requests_per_unit: 3}}\n",
            unit.to_uppercase()
        );
        let config = Config::parse("units.yaml", &text).expect(unit);
        let quota = config.rule(&[("a", "x")]).unwrap().quota.unwrap();
        assert_eq!(quota.period(), Duration::from_secs(secs), "{unit}");
    }
}

#[test]
fn wildcards_match_anywhere_in_a_value_as_the_reference_reads_them() {
    let config = Config::parse("wildcard.yaml", REFERENCE_WILDCARD).expect("parses");
    let limit = |entries: &[(&str, &str)]| {
        config
            .rule(entries)
            .and_then(|r| r.quota)
            .map(|q| (q.limit(), config.rule(entries).unwrap().path.clone()))
    };
    assert_eq!(limit(&[("wild", "foo")]).unwrap().1, "wild=foo*");
    assert_eq!(limit(&[("wild", "foo123")]).unwrap().1, "wild=foo*");
    assert_eq!(limit(&[("wild", "fo")]), None);
    assert_eq!(limit(&[("noWild", "foo1")]), None);
    assert_eq!(limit(&[("midWild", "barab")]).unwrap().1, "midWild=bar*b");
    assert_eq!(limit(&[("midWild", "barb")]).unwrap().1, "midWild=bar*b");
    assert_eq!(limit(&[("midWild", "bar")]), None);
    assert_eq!(limit(&[("midWild", "barba")]), None);
    assert_eq!(
        limit(&[("multiWild", "foo1bar2baz")]).unwrap(),
        (10, "multiWild=foo*bar*baz".to_owned())
    );
    assert_eq!(limit(&[("multiWild", "foobarbaz")]).unwrap().0, 10);
    assert_eq!(limit(&[("multiWild", "foobaz")]), None);
    assert_eq!(limit(&[("multiWild", "foo1bar2ba")]), None);
    assert_eq!(
        limit(&[("nestedWild", "val1"), ("wild", "goose")])
            .unwrap()
            .1,
        "nestedWild=val1/wild=goo*"
    );
    // The first wildcard in file order wins, as in the reference.
    let ordered = Config::parse(
        "order.yaml",
        "domain: d\ndescriptors:\n  - key: a\n    value: \"1*\"\n    rate_limit: {unit: second, requests_per_unit: 1}\n  - key: a\n    value: \"12*\"\n    rate_limit: {unit: second, requests_per_unit: 2}\n",
    )
    .unwrap();
    assert_eq!(ordered.rule(&[("a", "123")]).unwrap().path, "a=1*");
}

#[test]
fn zero_requests_per_unit_blocks_every_request_as_in_the_reference() {
    let config = Config::parse(
        "block.yaml",
        "domain: d\ndescriptors:\n  - key: ip\n    value: 203.0.113.9\n    rate_limit: {unit: hour, requests_per_unit: 0}\n  - key: ip\n    rate_limit: {unit: second, requests_per_unit: 9}\n",
    )
    .unwrap();
    let blocked = config.rule(&[("ip", "203.0.113.9")]).unwrap();
    assert_eq!(blocked.quota, None);
    assert_eq!(blocked.blocks, Some(Duration::from_secs(3_600)));
    let other = config.rule(&[("ip", "198.51.100.1")]).unwrap();
    assert_eq!((other.blocks, other.quota.unwrap().limit()), (None, 9));
}

/// envoyproxy/ratelimit's `test/config/merge_domain_key1.yaml` and
/// `merge_domain_key2.yaml` (Apache License 2.0, copyright the Envoy
/// Project Authors).
const MERGE_KEY1: &str = "domain: test-domain\ndescriptors:\n  - key: key1\n    value: value1\n    rate_limit:\n      unit: minute\n      requests_per_unit: 10\n";
const MERGE_KEY2: &str = "domain: test-domain\ndescriptors:\n  - key: key2\n    value: value2\n    rate_limit:\n      unit: minute\n      requests_per_unit: 20\n";

#[test]
fn files_of_one_domain_merge_and_a_descriptor_in_both_is_refused() {
    let one = Config::parse("merge_domain_key1.yaml", MERGE_KEY1).unwrap();
    let two = Config::parse("merge_domain_key2.yaml", MERGE_KEY2).unwrap();
    let merged = one.clone().merge(two).unwrap();
    let limit = |entries: &[(&str, &str)]| merged.rule(entries).unwrap().quota.unwrap().limit();
    assert_eq!(limit(&[("key1", "value1")]), 10);
    assert_eq!(limit(&[("key2", "value2")]), 20);
    assert!(merged.rule(&[]).is_none());
    let twice = Config::parse("again.yaml", MERGE_KEY1).unwrap();
    let err = one.merge(twice).unwrap_err().to_string();
    for word in [
        "merge_domain_key1.yaml",
        "again.yaml",
        "key1=value1",
        "both",
    ] {
        assert!(err.contains(word), "{word:?} missing from: {err}");
    }
}

#[test]
fn an_empty_descriptors_list_is_no_descriptors() {
    let config = Config::parse("empty.yaml", "domain: d\ndescriptors:\n").unwrap();
    assert!(config.rules().is_empty());
}

#[test]
fn the_references_fixtures_load_with_their_metric_and_sharing_fields() {
    let basic = Config::parse("basic_config.yaml", REFERENCE_BASIC).expect("parses");
    let key7 = basic.rule(&[("key7", "anything")]).expect("key7's rule");
    assert!(key7.detailed_metric);
    assert_eq!(key7.quota.unwrap().limit(), 70);

    let shared = Config::parse("share_threshold.yaml", REFERENCE_SHARE_THRESHOLD).expect("parses");
    let files = shared.rule(&[("files", "files/a.pdf")]).expect("files/*");
    assert_eq!(files.levels[0].shared.as_deref(), Some("files/*"));
    // An exact value wins over a sharing wildcard.
    let exact = shared.rule(&[("file", "test1")]).expect("test1");
    assert_eq!(exact.quota.unwrap().limit(), 50);
    assert_eq!(exact.levels[0].shared, None);
    // Mixed: the first level shares, the second does not.
    let mixed = shared
        .rule(&[("path", "path/x"), ("file", "file/y"), ("type", "pdf")])
        .expect("path/file/type");
    let levels: Vec<bool> = mixed.levels.iter().map(|l| l.shared.is_some()).collect();
    assert_eq!(levels, [true, false, false]);
    let route = shared
        .rule(&[("route", "api/v1"), ("method", "GET")])
        .expect("route/method");
    assert!(route.levels[0].value_to_metric);

    let metadata = Config::parse("metadata.yaml", REFERENCE_METADATA).expect("parses");
    assert_eq!(metadata.rules().len(), 3);
}

#[test]
fn a_rule_that_replaces_itself_or_nothing_is_refused_naming_the_field() {
    for (file, text) in [
        ("replaces_self.yaml", REFERENCE_REPLACES_SELF),
        ("replaces_empty.yaml", REFERENCE_REPLACES_EMPTY),
    ] {
        let e = Config::parse(file, text).unwrap_err().to_string();
        assert!(
            e.contains(file) && e.contains("key1=value1/subkey1") && e.contains("replaces"),
            "{e}"
        );
    }
    let literal = "domain: d\ndescriptors:\n  - key: k\n    value: plain\n    share_threshold: true\n    rate_limit: { unit: minute, requests_per_unit: 1 }\n";
    let e = Config::parse("d.yaml", literal).unwrap_err().to_string();
    assert!(
        e.contains("share_threshold") && e.contains("k=plain"),
        "{e}"
    );
}

/// The reference's `config_test.go` refusals: each of its broken
/// fixtures is refused here too, naming the file (and what it names).
#[test]
fn the_references_broken_files_are_refused_naming_what_is_wrong() {
    let cases: [(&str, &str, &[&str]); 11] = [
        (
            "empty_domain.yaml",
            include_str!("../../tests/reference/empty_domain.yaml"),
            &["domain"],
        ),
        (
            "empty_key.yaml",
            include_str!("../../tests/reference/empty_key.yaml"),
            &["key"],
        ),
        (
            "duplicate_key.yaml",
            include_str!("../../tests/reference/duplicate_key.yaml"),
            &["key1=value1", "twice"],
        ),
        (
            "bad_limit_unit.yaml",
            include_str!("../../tests/reference/bad_limit_unit.yaml"),
            &["unit", "foo"],
        ),
        (
            "bad_yaml.yaml",
            include_str!("../../tests/reference/bad_yaml.yaml"),
            &["YAML"],
        ),
        (
            "misspelled_key.yaml",
            include_str!("../../tests/reference/misspelled_key.yaml"),
            &["ratelimit"],
        ),
        (
            "misspelled_key2.yaml",
            include_str!("../../tests/reference/misspelled_key2.yaml"),
            &["requestsperunit"],
        ),
        (
            "non_string_key.yaml",
            include_str!("../../tests/reference/non_string_key.yaml"),
            &["0.25"],
        ),
        (
            "non_map_list.yaml",
            include_str!("../../tests/reference/non_map_list.yaml"),
            &["mapping"],
        ),
        (
            "unlimited_with_unit.yaml",
            include_str!("../../tests/reference/unlimited_with_unit.yaml"),
            &["unlimited", "unit"],
        ),
        ("replaces_self.yaml", REFERENCE_REPLACES_SELF, &["replace"]),
    ];
    for (file, text, words) in cases {
        let e = Config::parse(file, text).unwrap_err().to_string();
        assert!(e.contains(file), "{file}: {e}");
        for word in words {
            assert!(e.contains(word), "{file}: {e} (expected {word:?})");
        }
    }
    // Two files of one domain: refused unless merged.
    let basic = Config::parse("basic_config.yaml", REFERENCE_BASIC).unwrap();
    let duplicate = Config::parse(
        "duplicate_domain.yaml",
        include_str!("../../tests/reference/duplicate_domain.yaml"),
    )
    .unwrap();
    assert_eq!(basic.domain(), duplicate.domain());
    let shadow = Config::parse(
        "shadowmode_config.yaml",
        include_str!("../../tests/reference/shadowmode_config.yaml"),
    )
    .expect("the shadow mode fixture loads");
    assert!(shadow.rules().iter().any(|r| r.shadow_mode));
}
