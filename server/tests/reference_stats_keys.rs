//! envoyproxy/ratelimit's stats-key tests (in its
//! `test/config/config_test.go`: `TestDetailedMetric`,
//! `TestValueToMetric_*`, `TestWildcardStatsBehavior`), on their inline
//! configurations, asked of slicelimit-server's service: a rule's stats
//! key is the `rule` label of the series a request counts in (the
//! reference's `domain.route_draw.http_method_GET.subject_id` is
//! `route=draw/http_method=GET/subject_id` here: the `docs/migrating.md`
//! Stats table). On a private Redis, in the exact and the hybrid-strict
//! mode.

#[path = "reference/harness.rs"]
mod harness;
mod rls;

use harness::{counted, fresh, MODES};
use rls::{descriptor, request};
use slicelimit_sim::RedisServer;

/// One inline configuration of the reference's stats-key tests: its
/// descriptors, the requests asked, and the series they count in.
struct Labelled {
    test: &'static str,
    descriptors: &'static str,
    requests: &'static [&'static [(&'static str, &'static str)]],
    want: &'static [&'static str],
}

const NESTED: &str = "
  - key: key-1
    rate_limit: { requests_per_unit: 100, unit: minute }
    detailed_metric: DETAILED
    descriptors:
      - key: key-2
        rate_limit: { requests_per_unit: 5, unit: minute }
        detailed_metric: DETAILED";

const REALISTIC: &str = "
  - key: key_1
    rate_limit: { requests_per_unit: 500, unit: minute }
    detailed_metric: true
  - key: key_1
    value: some-value-for-key-1
    rate_limit: { requests_per_unit: 500, unit: minute }
  - key: key_2
    rate_limit: { requests_per_unit: 5000, unit: minute }
    detailed_metric: true
    descriptors:
      - key: key_3
        detailed_metric: true
      - key: key_3
        value: requested-key3-value
        rate_limit: { requests_per_unit: 5, unit: minute }
        detailed_metric: true
  - key: key_2
    value: specific-id
    rate_limit: { requests_per_unit: 50000, unit: minute }
    detailed_metric: true
    descriptors:
      - key: key_3
        detailed_metric: true
      - key: key_3
        value: requested-key3-value
        rate_limit: { requests_per_unit: 100, unit: minute }
        detailed_metric: true";

const ROUTE_METHOD_SUBJECT: &str = "
  - key: route
    value_to_metric: true
    descriptors:
      - key: http_method
        value_to_metric: true
        descriptors:
          - key: subject_id
            rate_limit: { requests_per_unit: 60, unit: minute }";

/// The reference's stats-key cases (`TestDetailedMetric`,
/// `TestValueToMetric_*`, `TestWildcardStatsBehavior`).
const LABELLED: &[Labelled] = &[
    Labelled {
        test: "TestDetailedMetric: top-level key only, detailed",
        descriptors: "NESTED_TRUE",
        requests: &[&[("key-1", "value-1")]],
        want: &["key-1=value-1"],
    },
    Labelled {
        test: "TestDetailedMetric: top-level key only, not detailed",
        descriptors: "NESTED_FALSE",
        requests: &[&[("key-1", "value-1")]],
        want: &["key-1"],
    },
    Labelled {
        test: "TestDetailedMetric: fully nested, detailed",
        descriptors: "NESTED_TRUE",
        requests: &[&[("key-1", "value-1"), ("key-2", "value-2")]],
        want: &["key-1=value-1/key-2=value-2"],
    },
    Labelled {
        test: "TestDetailedMetric: fully nested, not detailed",
        descriptors: "NESTED_FALSE",
        requests: &[&[("key-1", "value-1"), ("key-2", "value-2")]],
        want: &["key-1/key-2"],
    },
    Labelled {
        test: "TestDetailedMetric: realistic, simple request",
        descriptors: REALISTIC,
        requests: &[&[("key_1", "value-for-key-1")]],
        want: &["key_1=value-for-key-1"],
    },
    Labelled {
        test: "TestDetailedMetric: realistic, second key only",
        descriptors: REALISTIC,
        requests: &[&[("key_2", "key-2-value")]],
        want: &["key_2=key-2-value"],
    },
    Labelled {
        test: "TestDetailedMetric: realistic, nested request",
        descriptors: REALISTIC,
        requests: &[&[("key_2", "key-2-value"), ("key_3", "requested-key3-value")]],
        want: &["key_2=key-2-value/key_3=requested-key3-value"],
    },
    Labelled {
        test: "TestValueToMetric_UsesRuntimeValuesInStats",
        descriptors: ROUTE_METHOD_SUBJECT,
        requests: &[&[
            ("route", "draw"),
            ("http_method", "GET"),
            ("subject_id", "123"),
        ]],
        want: &["route=draw/http_method=GET/subject_id"],
    },
    Labelled {
        test: "TestValueToMetric_DefaultKeyIncludesValueAtThatLevel",
        descriptors: "
  - key: k1
    value_to_metric: true
    descriptors:
      - key: k2
        rate_limit: { requests_per_unit: 1, unit: second }",
        requests: &[&[("k1", "A"), ("k2", "foo")]],
        want: &["k1=A/k2"],
    },
    Labelled {
        test: "TestValueToMetric_MidLevelOnly",
        descriptors: "
  - key: k1
    descriptors:
      - key: k2
        value_to_metric: true
        descriptors:
          - key: k3
            rate_limit: { requests_per_unit: 1, unit: second }",
        requests: &[&[("k1", "X"), ("k2", "Y"), ("k3", "Z")]],
        want: &["k1/k2=Y/k3"],
    },
    Labelled {
        test: "TestValueToMetric_NoFlag_Unchanged",
        descriptors: "
  - key: k1
    descriptors:
      - key: k2
        rate_limit: { requests_per_unit: 1, unit: second }",
        requests: &[&[("k1", "X"), ("k2", "Y")]],
        want: &["k1/k2"],
    },
    Labelled {
        test: "TestValueToMetric_DoesNotOverrideDetailedMetric",
        descriptors: "
  - key: route
    value_to_metric: true
    descriptors:
      - key: http_method
        value_to_metric: true
        descriptors:
          - key: subject_id
            detailed_metric: true
            rate_limit: { requests_per_unit: 60, unit: minute }",
        requests: &[&[
            ("route", "draw"),
            ("http_method", "GET"),
            ("subject_id", "123"),
        ]],
        want: &["route=draw/http_method=GET/subject_id=123"],
    },
    Labelled {
        test: "TestValueToMetric_WithConfiguredValues",
        descriptors: "
  - key: route
    value_to_metric: true
    descriptors:
      - key: http_method
        value: GET
        value_to_metric: true
        descriptors:
          - key: subject_id
            rate_limit: { requests_per_unit: 60, unit: minute }
      - key: http_method
        value: POST
        value_to_metric: true
        descriptors:
          - key: subject_id
            rate_limit: { requests_per_unit: 30, unit: minute }",
        requests: &[
            &[
                ("route", "api"),
                ("http_method", "GET"),
                ("subject_id", "user123"),
            ],
            &[
                ("route", "api"),
                ("http_method", "POST"),
                ("subject_id", "user456"),
            ],
        ],
        want: &[
            "route=api/http_method=GET/subject_id",
            "route=api/http_method=POST/subject_id",
        ],
    },
    Labelled {
        test: "TestValueToMetric_WithWildcard",
        descriptors: "
  - key: user
    value_to_metric: true
    descriptors:
      - key: action
        value: read*
        value_to_metric: true
        descriptors:
          - key: resource
            rate_limit: { requests_per_unit: 100, unit: minute }",
        requests: &[
            &[
                ("user", "alice"),
                ("action", "readfile"),
                ("resource", "documents"),
            ],
            &[
                ("user", "bob"),
                ("action", "readdata"),
                ("resource", "database"),
            ],
        ],
        want: &[
            "user=alice/action=readfile/resource",
            "user=bob/action=readdata/resource",
        ],
    },
    // The reference leaves an empty value out of its key (`route`, not
    // `route_`); here the label is `key=value` with the value as
    // requested, empty too (the Stats table's `rule` label).
    Labelled {
        test: "TestValueToMetric_WithEmptyValue",
        descriptors: ROUTE_METHOD_SUBJECT,
        requests: &[
            &[("route", ""), ("http_method", "GET"), ("subject_id", "123")],
            &[
                ("route", "draw"),
                ("http_method", ""),
                ("subject_id", "123"),
            ],
            &[("route", ""), ("http_method", ""), ("subject_id", "123")],
        ],
        want: &[
            "route=/http_method=GET/subject_id",
            "route=draw/http_method=/subject_id",
            "route=/http_method=/subject_id",
        ],
    },
    Labelled {
        test: "TestWildcardStatsBehavior: no flags",
        descriptors: "
  - key: wild
    value: foo*
    rate_limit: { requests_per_unit: 20, unit: minute }",
        requests: &[&[("wild", "foo1")]],
        want: &["wild=foo*"],
    },
    Labelled {
        test: "TestWildcardStatsBehavior: value_to_metric",
        descriptors: "
  - key: wild
    value: foo*
    value_to_metric: true
    rate_limit: { requests_per_unit: 20, unit: minute }",
        requests: &[&[("wild", "foo1")]],
        want: &["wild=foo1"],
    },
    Labelled {
        test: "TestWildcardStatsBehavior: share_threshold",
        descriptors: "
  - key: wild
    value: foo*
    share_threshold: true
    rate_limit: { requests_per_unit: 20, unit: minute }",
        requests: &[&[("wild", "foo1")]],
        want: &["wild=foo*"],
    },
    Labelled {
        test: "TestWildcardStatsBehavior: share_threshold with value_to_metric",
        descriptors: "
  - key: wild
    value: foo*
    share_threshold: true
    value_to_metric: true
    rate_limit: { requests_per_unit: 20, unit: minute }",
        requests: &[&[("wild", "foo1")]],
        want: &["wild=foo*"],
    },
    Labelled {
        test: "TestWildcardStatsBehavior: value_to_metric in another descriptor",
        descriptors: "
  - key: wild
    value: foo*
    descriptors:
      - key: other
        value_to_metric: true
        descriptors:
          - key: limit
            rate_limit: { requests_per_unit: 20, unit: minute }",
        requests: &[&[("wild", "foo1"), ("other", "bar"), ("limit", "X")]],
        want: &["wild=foo*/other=bar/limit"],
    },
    Labelled {
        test: "TestWildcardStatsBehavior: middle and trailing, no flags",
        descriptors: "
  - key: wild
    value: foo*bar*
    rate_limit: { requests_per_unit: 20, unit: minute }",
        requests: &[&[("wild", "foo123bar456")], &[("wild", "fooXbarY")]],
        want: &["wild=foo*bar*", "wild=foo*bar*"],
    },
    Labelled {
        test: "TestWildcardStatsBehavior: middle and trailing, value_to_metric",
        descriptors: "
  - key: wild
    value: foo*bar*
    value_to_metric: true
    rate_limit: { requests_per_unit: 20, unit: minute }",
        requests: &[&[("wild", "foo123bar456")]],
        want: &["wild=foo123bar456"],
    },
];

/// The reference's stats keys, as the `rule` label of the series a
/// request counts in (`detailed_metric`, `value_to_metric`, wildcards).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_references_stats_keys_are_the_series_rule_labels() {
    for mode in MODES {
        let redis = RedisServer::start();
        let mut files = Vec::new();
        let mut domains = Vec::new();
        for case in LABELLED {
            let domain = fresh("labelled");
            let descriptors = match case.descriptors {
                "NESTED_TRUE" => NESTED.replace("DETAILED", "true"),
                "NESTED_FALSE" => NESTED.replace("DETAILED", "false"),
                text => text.to_owned(),
            };
            files.push(format!("domain: {domain}\ndescriptors:{descriptors}\n"));
            domains.push(domain);
        }
        let named: Vec<(&str, &str)> = files.iter().map(|f| ("inline.yaml", f.as_str())).collect();
        let c = harness::service(&redis, mode, &named).await;
        for (case, domain) in LABELLED.iter().zip(&domains) {
            for entries in case.requests {
                let r = c
                    .decide(request(domain, vec![descriptor(entries)]))
                    .await
                    .unwrap();
                assert!(
                    r.statuses[0].current_limit.is_some(),
                    "{}: no rule",
                    case.test
                );
            }
            let mut want: Vec<(String, u64)> = Vec::new();
            for label in case.want {
                match want.iter_mut().find(|(l, _)| l == label) {
                    Some((_, n)) => *n += 1,
                    None => want.push(((*label).to_owned(), 1)),
                }
            }
            want.sort();
            assert_eq!(counted(domain), want, "{mode:?} {}", case.test);
        }
    }
}
