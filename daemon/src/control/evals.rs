//! `GET /v1/evals?since=STEP`: the evaluations this node logged (`evals.jsonl` in its data
//! directory, each with the training loss before it), after a step, in the order they were
//! logged and at most [`EVALS_PER_RESPONSE`] at a time: what the live page reads to draw the
//! whole run after a reload, and what a script reads instead of the file.

use serde::{Deserialize, Serialize};

use crate::trainer::EvalRecord;

/// Evaluations in one answer at most; `more` says whether the log holds others after them.
pub const EVALS_PER_RESPONSE: usize = 2_000;

/// The query: evaluations at steps after `since` (all of them without it).
#[derive(Debug, Default, Deserialize)]
pub struct EvalsQuery {
    /// Only evaluations at a step above this one.
    pub since: Option<u64>,
}

/// One answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalsPage {
    /// The evaluations, as logged.
    pub evals: Vec<EvalRecord>,
    /// Whether more evaluations after these match: ask again with `since` the last one's step.
    pub more: bool,
}

/// The evaluations of the log `text` after step `since`, at most `cap`; a line that is not an
/// evaluation (a log cut short by a kill, one edited by hand) is skipped.
pub fn page(text: &str, since: Option<u64>, cap: usize) -> EvalsPage {
    let mut matching = text
        .lines()
        .filter_map(|l| serde_json::from_str::<EvalRecord>(l).ok())
        .filter(|e| since.is_none_or(|s| e.step > s));
    let evals: Vec<EvalRecord> = matching.by_ref().take(cap).collect();
    let more = matching.next().is_some();
    EvalsPage { evals, more }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(step: u64) -> String {
        format!(
            "{{\"step\":{step},\"unix_ms\":{},\"loss\":0.5,\"accuracy\":0.9,\"bits_per_byte\":null,\"eval_secs\":1.0,\"train_loss\":0.4}}",
            1_000 + step
        )
    }

    #[test]
    fn evaluations_after_a_step_come_in_capped_pages_and_bad_lines_are_skipped() {
        let mut text: String = (1..=5).map(|s| line(s * 100) + "\n").collect();
        // An older line without the training loss, a torn last line, and garbage.
        text.push_str(
            "{\"step\":600,\"unix_ms\":1600,\"loss\":0.5,\"accuracy\":0.9,\"bits_per_byte\":0.7}\n",
        );
        text.push_str("not json\n{\"step\":700,\"unix_ms\"");
        let all = page(&text, None, 10);
        assert_eq!(
            all.evals.iter().map(|e| e.step).collect::<Vec<_>>(),
            [100, 200, 300, 400, 500, 600]
        );
        assert!(!all.more);
        assert_eq!(all.evals[0].train_loss, Some(0.4));
        assert_eq!(all.evals[5].train_loss, None);
        let first = page(&text, Some(150), 2);
        assert_eq!(
            first.evals.iter().map(|e| e.step).collect::<Vec<_>>(),
            [200, 300]
        );
        assert!(first.more);
        let rest = page(&text, Some(300), 2);
        assert_eq!(
            rest.evals.iter().map(|e| e.step).collect::<Vec<_>>(),
            [400, 500]
        );
        assert!(rest.more);
        let last = page(&text, Some(500), 2);
        assert_eq!(last.evals.len(), 1);
        assert!(!last.more);
        assert_eq!(
            page("", None, 2),
            EvalsPage {
                evals: vec![],
                more: false
            }
        );
    }
}
