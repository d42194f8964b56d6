//! The relay's topics: created when missing, and checked at start for what would lose or
//! stall work (a topic missing, partitions other than configured, a `min.insync.replicas` that
//! makes `acks=all` meaningless or impossible).

use std::sync::Arc;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use super::client_config;
use crate::config::KafkaConfig;

/// Creates the actions, outcomes and dead-letter topics when they are missing.
pub async fn ensure_topics(cfg: &KafkaConfig) -> Result<(), KafkaError> {
    let admin: AdminClient<DefaultClientContext> = client_config(cfg).create()?;
    // -1 asks the broker for its `default.replication.factor` (brokers since Kafka 2.4).
    let replication = || TopicReplication::Fixed(cfg.replication_factor.unwrap_or(-1));
    let topics = [
        NewTopic::new(&cfg.actions_topic, cfg.partitions, replication()),
        NewTopic::new(&cfg.outcomes_topic, cfg.partitions, replication()),
        NewTopic::new(&cfg.dlq_topic, 1, replication()),
    ];
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for result in admin.create_topics(&topics, &opts).await? {
        match result {
            Ok(_) => {}
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(KafkaError::AdminOp(code)).inspect_err(|_| {
                    tracing::error!(topic, ?code, "cannot create topic");
                })
            }
        }
    }
    Ok(())
}

/// What the brokers say of one topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicShape {
    pub partitions: i32,
    /// Replicas of its first partition.
    pub replication: i32,
    /// `min.insync.replicas`, when the broker said.
    pub min_insync: Option<i32>,
    /// `max.message.bytes`, when the broker said: the largest record batch it takes.
    pub max_message_bytes: Option<i64>,
}

/// What is wrong with a topic the relay uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopicProblem {
    /// Not there and not to be created: the relay cannot work.
    Missing,
    /// More than the replicas: every `acks=all` write is refused.
    InsyncAboveReplicas { min_insync: i32, replication: i32 },
    /// Replicated, yet an `acks=all` write is acknowledged by the leader alone when its
    /// followers fall behind; losing that broker loses the write.
    InsyncOfOne { replication: i32 },
    /// Other than `kafka.partitions`: works, with other parallelism than configured.
    Partitions { found: i32, configured: i32 },
}

impl TopicProblem {
    /// Whether the relay must not start: it could not read its actions or write its answers.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            TopicProblem::Missing | TopicProblem::InsyncAboveReplicas { .. }
        )
    }
}

impl std::fmt::Display for TopicProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TopicProblem::Missing => write!(f, "does not exist (and kafka.create_topics is off)"),
            TopicProblem::InsyncAboveReplicas { min_insync, replication } => write!(
                f,
                "min.insync.replicas is {min_insync} with {replication} replica(s): every acks=all write is refused"
            ),
            TopicProblem::InsyncOfOne { replication } => write!(
                f,
                "min.insync.replicas is 1 with {replication} replicas: acks=all is acknowledged by the leader alone when followers lag; set it to 2 or more"
            ),
            TopicProblem::Partitions { found, configured } => write!(
                f,
                "has {found} partition(s), kafka.partitions says {configured}"
            ),
        }
    }
}

/// The problems of one topic; `partitions` is `None` where the count is not configured (the
/// dead-letter topic).
pub fn problems(shape: Option<&TopicShape>, partitions: Option<i32>) -> Vec<TopicProblem> {
    let Some(shape) = shape else {
        return vec![TopicProblem::Missing];
    };
    let mut found = Vec::new();
    match shape.min_insync {
        Some(min) if min > shape.replication => found.push(TopicProblem::InsyncAboveReplicas {
            min_insync: min,
            replication: shape.replication,
        }),
        Some(1) if shape.replication > 1 => found.push(TopicProblem::InsyncOfOne {
            replication: shape.replication,
        }),
        _ => {}
    }
    if let Some(configured) = partitions.filter(|c| *c != shape.partitions) {
        found.push(TopicProblem::Partitions {
            found: shape.partitions,
            configured,
        });
    }
    found
}

/// Asks the brokers about the actions, outcomes and dead-letter topics; logs every problem and
/// fails on the ones the relay cannot work with. Returns the smallest `max.message.bytes` of
/// the topics the relay produces to (outcomes, dead letters), when the brokers said.
pub async fn check_topics(cfg: &KafkaConfig) -> Result<Option<i64>, String> {
    let admin: Arc<AdminClient<DefaultClientContext>> =
        Arc::new(client_config(cfg).create().map_err(|e| e.to_string())?);
    // The dead-letter topic may be missing: bad input then waits (its batch is read again)
    // until the topic exists, and everything else flows.
    // (topic, partitions expected, required, the relay produces to it)
    let names = [
        (cfg.actions_topic.clone(), Some(cfg.partitions), true, false),
        (cfg.outcomes_topic.clone(), Some(cfg.partitions), true, true),
        (cfg.dlq_topic.clone(), None, false, true),
    ];
    let mut fatal = Vec::new();
    let mut produce_limit: Option<i64> = None;
    for (topic, partitions, required, produced_to) in names {
        let shape = describe_settled(&admin, &topic).await?;
        if let Some(limit) = shape.as_ref().and_then(|s| s.max_message_bytes) {
            if produced_to {
                produce_limit = Some(produce_limit.map_or(limit, |l| l.min(limit)));
            }
        }
        for problem in problems(shape.as_ref(), partitions) {
            if problem.is_fatal() && (required || problem != TopicProblem::Missing) {
                tracing::error!(topic, problem = %problem, "topic unusable");
                fatal.push(format!("topic {topic} {problem}"));
            } else {
                tracing::warn!(topic, problem = %problem, "topic configured other than expected");
            }
        }
    }
    if fatal.is_empty() {
        Ok(produce_limit)
    } else {
        Err(fatal.join("; "))
    }
}

/// A topic created a moment ago may not be in every broker's metadata yet: asked again for a
/// few seconds before it counts as missing.
async fn describe_settled(
    admin: &Arc<AdminClient<DefaultClientContext>>,
    topic: &str,
) -> Result<Option<TopicShape>, String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let shape = describe(admin, topic).await?;
        if shape.is_some() || tokio::time::Instant::now() >= deadline {
            return Ok(shape);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn describe(
    admin: &Arc<AdminClient<DefaultClientContext>>,
    topic: &str,
) -> Result<Option<TopicShape>, String> {
    let metadata = {
        // Blocking in librdkafka: off the runtime's threads.
        let (admin, name) = (admin.clone(), topic.to_string());
        tokio::task::spawn_blocking(move || {
            admin
                .inner()
                .fetch_metadata(Some(&name), Duration::from_secs(10))
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("metadata of topic {topic}: {e}"))?
    };
    let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(None);
    };
    if t.error().is_some() || t.partitions().is_empty() {
        return Ok(None);
    }
    let replication = t.partitions()[0].replicas().len() as i32;
    let opts = AdminOptions::new().request_timeout(Some(Duration::from_secs(10)));
    let resource = admin
        .describe_configs(&[ResourceSpecifier::Topic(topic)], &opts)
        .await
        .ok()
        .and_then(|mut results| results.pop())
        .and_then(Result::ok);
    let setting = |name: &str| {
        resource
            .as_ref()
            .and_then(|r| r.get(name))
            .and_then(|e| e.value.as_deref())
            .map(str::to_string)
    };
    Ok(Some(TopicShape {
        partitions: t.partitions().len() as i32,
        replication,
        min_insync: setting("min.insync.replicas").and_then(|v| v.parse().ok()),
        max_message_bytes: setting("max.message.bytes").and_then(|v| v.parse().ok()),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(partitions: i32, replication: i32, min_insync: Option<i32>) -> TopicShape {
        TopicShape {
            partitions,
            replication,
            min_insync,
            max_message_bytes: None,
        }
    }

    #[test]
    fn a_healthy_topic_has_no_problem() {
        assert!(problems(Some(&shape(6, 3, Some(2))), Some(6)).is_empty());
        assert!(problems(Some(&shape(6, 1, Some(1))), Some(6)).is_empty());
        assert!(problems(Some(&shape(1, 1, None)), None).is_empty());
    }

    #[test]
    fn each_problem_is_found_and_only_the_unworkable_ones_are_fatal() {
        assert_eq!(problems(None, Some(6)), vec![TopicProblem::Missing]);
        let p = problems(Some(&shape(6, 1, Some(2))), Some(6));
        assert_eq!(
            p,
            vec![TopicProblem::InsyncAboveReplicas {
                min_insync: 2,
                replication: 1
            }]
        );
        assert!(p[0].is_fatal());
        let p = problems(Some(&shape(3, 3, Some(1))), Some(6));
        assert_eq!(
            p,
            vec![
                TopicProblem::InsyncOfOne { replication: 3 },
                TopicProblem::Partitions {
                    found: 3,
                    configured: 6
                }
            ]
        );
        assert!(p.iter().all(|p| !p.is_fatal()));
        assert!(p[0].to_string().contains("set it to 2"));
    }
}
