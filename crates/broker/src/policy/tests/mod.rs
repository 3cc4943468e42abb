use super::*;

fn def(pairs: &[(&str, PolicyValue)]) -> Definition {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), v.clone()))
        .collect()
}

fn pol(name: &str, kind: PolicyKind, pattern: &str, priority: i64, d: Definition) -> PolicyDef {
    PolicyDef {
        vhost: "/".into(),
        name: name.into(),
        kind,
        pattern: pattern.into(),
        apply_to: ApplyTo::All,
        priority,
        definition: d,
    }
}

fn int(i: i64) -> PolicyValue {
    PolicyValue::Int(i)
}

fn s(v: &str) -> PolicyValue {
    PolicyValue::Str(v.into())
}

fn invalid(kind: PolicyKind, d: Definition) -> String {
    match validate_definition(kind, &d) {
        Err(PolicyError::Invalid(r)) => r,
        other => panic!("accepted: {other:?}"),
    }
}

#[test]
fn validation_texts() {
    use PolicyKind::*;
    assert_eq!(
        invalid(User, def(&[("max-length", int(-1))])),
        "-1 is not a valid maximum length"
    );
    assert_eq!(
        invalid(User, def(&[("message-ttl", s("10"))])),
        "<<\"10\">> is not a valid message TTL"
    );
    assert_eq!(
        invalid(User, def(&[("expires", int(0))])),
        "0 is not a valid queue expiry"
    );
    assert_eq!(
        invalid(User, def(&[("dead-letter-exchange", int(1))])),
        "1 is not a valid dead letter exchange name"
    );
    assert_eq!(
        invalid(User, def(&[("overflow", s("drop-tail"))])),
        "<<\"drop-tail\">> is not a valid overflow value"
    );
    assert_eq!(
        invalid(User, def(&[("queue-mode", s("eager"))])),
        "<<\"eager\">> is not a valid queue-mode value"
    );
    assert_eq!(
        invalid(User, def(&[("queue-leader-locator", s("nearest"))])),
        "<<\"nearest\">> is not a valid queue leader locator value"
    );
    assert_eq!(
        invalid(User, def(&[("max-lenght", int(10))])),
        "[{<<\"max-lenght\">>,10}] are not recognised policy settings"
    );
    assert_eq!(invalid(User, def(&[])), "no policy provided");
    // An operator policy may only cap.
    assert_eq!(
        invalid(Operator, def(&[("dead-letter-exchange", s("dlx"))])),
        "[{<<\"dead-letter-exchange\">>,<<\"dlx\">>}] are not recognised policy settings"
    );
    assert!(validate_definition(
        User,
        &def(&[
            ("ha-mode", s("all")),
            ("max-length", int(0)),
            ("visibility-timeout", int(30_000)),
            ("delayed-retry-type", s("failed")),
        ])
    )
    .is_ok());
    assert_eq!(
        PolicyError::Invalid("x".into()).to_string(),
        "Validation failed\n\nx\n"
    );
    assert!(validate_pattern("(").is_err());
    // RabbitMQ's patterns are PCRE: the look-ahead of many a runbook is taken.
    let re = validate_pattern(r"^(?!amq\.).*").expect("look-ahead");
    assert!(re.is_match("jobs").unwrap_or(false));
    assert!(!re.is_match("amq.gen-1").unwrap_or(true));
    assert!(parse_apply_to("bindings").is_err());
}

#[test]
fn highest_priority_wins_and_ties_go_by_name() {
    let mut t = PolicyTable::default();
    let d = def(&[("max-length", int(1))]);
    t.put(pol("b-low", PolicyKind::User, "^orders", 1, d.clone()))
        .unwrap();
    t.put(pol("a-high", PolicyKind::User, "^ord", 5, d.clone()))
        .unwrap();
    t.put(pol("z-high", PolicyKind::User, "ers$", 5, d.clone()))
        .unwrap();
    t.put(pol("op", PolicyKind::Operator, ".*", 0, d.clone()))
        .unwrap();
    let q = Target::Queue(QueueType::Classic);
    let m = |t: &PolicyTable, name, kind| t.matching("/", kind, name, q).map(|p| p.name.clone());
    assert_eq!(m(&t, "orders", PolicyKind::User).as_deref(), Some("a-high"));
    assert_eq!(m(&t, "payments", PolicyKind::User), None);
    // Patterns are unanchored regular expressions, as RabbitMQ's.
    assert_eq!(
        m(&t, "old-orders", PolicyKind::User).as_deref(),
        Some("z-high")
    );
    assert_eq!(
        m(&t, "payments", PolicyKind::Operator).as_deref(),
        Some("op")
    );
    assert_eq!(t.matching("other", PolicyKind::User, "orders", q), None);
}

#[test]
fn apply_to_and_quorum_applicability() {
    let mut t = PolicyTable::default();
    let mut x = pol(
        "x",
        PolicyKind::User,
        ".*",
        9,
        def(&[("alternate-exchange", s("ae"))]),
    );
    x.apply_to = ApplyTo::Exchanges;
    t.put(x).unwrap();
    let mut cq = pol(
        "cq",
        PolicyKind::User,
        ".*",
        3,
        def(&[("max-length", int(1))]),
    );
    cq.apply_to = ApplyTo::ClassicQueues;
    t.put(cq).unwrap();
    // A quorum queue skips a policy with a key it does not take (mirroring).
    let ha = pol(
        "ha",
        PolicyKind::User,
        ".*",
        2,
        def(&[("ha-mode", s("all"))]),
    );
    t.put(ha).unwrap();
    let all = pol(
        "all",
        PolicyKind::User,
        ".*",
        1,
        def(&[("max-length", int(2))]),
    );
    t.put(all).unwrap();
    let m = |target| {
        t.matching("/", PolicyKind::User, "q", target)
            .map(|p| p.name.as_str())
    };
    assert_eq!(m(Target::Exchange), Some("x"));
    assert_eq!(m(Target::Queue(QueueType::Classic)), Some("cq"));
    assert_eq!(m(Target::Queue(QueueType::Quorum)), Some("all"));
}

#[test]
fn operator_policy_caps_and_arguments_precede() {
    let user = pol(
        "u",
        PolicyKind::User,
        ".*",
        0,
        def(&[
            ("max-length", int(100)),
            ("message-ttl", int(5_000)),
            ("dead-letter-exchange", s("policy-dlx")),
            ("overflow", s("reject-publish")),
        ]),
    );
    let op = pol(
        "o",
        PolicyKind::Operator,
        ".*",
        0,
        def(&[("max-length", int(10)), ("expires", int(60_000))]),
    );
    let eff = effective_definition(Some(&user), Some(&op));
    assert_eq!(eff.get("max-length"), Some(&int(10)));
    assert_eq!(eff.get("expires"), Some(&int(60_000)));
    assert_eq!(eff.get("message-ttl"), Some(&int(5_000)));

    let mut declared = FieldTable::new();
    declared.insert("x-dead-letter-exchange", FieldValue::long_str("own-dlx"));
    declared.insert("x-message-ttl", FieldValue::I32(1_000));
    declared.insert("x-max-length", FieldValue::I32(50));
    declared.insert("x-overflow", FieldValue::long_str("drop-head"));
    let args = effective_arguments(&declared, QueueType::Classic, &eff);
    // The argument beats the policy...
    assert_eq!(
        args.get("x-dead-letter-exchange"),
        Some(&FieldValue::long_str("own-dlx"))
    );
    assert_eq!(
        args.get("x-overflow"),
        Some(&FieldValue::long_str("drop-head"))
    );
    // ...but for a limit the lower value wins, and the operator's cap holds.
    assert_eq!(args.get("x-message-ttl"), Some(&FieldValue::I64(1_000)));
    assert_eq!(args.get("x-max-length"), Some(&FieldValue::I64(10)));
    assert_eq!(args.get("x-expires"), Some(&FieldValue::I64(60_000)));
    // A quorum queue takes the policy's overflow.
    let q = effective_arguments(&declared, QueueType::Quorum, &eff);
    assert_eq!(
        q.get("x-overflow"),
        Some(&FieldValue::long_str("reject-publish"))
    );
    // A policy's routing key without a dead-letter exchange is left out, not the policy.
    let rk = def(&[("dead-letter-routing-key", s("rk")), ("max-length", int(3))]);
    let args = effective_arguments(&FieldTable::new(), QueueType::Classic, &rk);
    assert_eq!(args.get("x-dead-letter-routing-key"), None);
    assert_eq!(args.get("x-max-length"), Some(&FieldValue::I64(3)));
    // Keys a queue type does not take are left out (queue-mode on a quorum queue).
    let lazy = def(&[("queue-mode", s("lazy"))]);
    assert!(effective_arguments(&FieldTable::new(), QueueType::Quorum, &lazy).is_empty());
}
