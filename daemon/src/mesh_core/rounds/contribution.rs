//! A `diloco` member's contribution to a parameter round: three parts of one length, its
//! parameters, its round start (anchor) and its outer velocity. A ring that carries the
//! state sends all three; one that does not sends the parameters, or, where the members
//! share the round start, the outer change (start minus parameters), from which each member
//! gets back the parameters the mean change leaves.

/// A `diloco` contribution without its state: the first of its three equal parts (the
/// parameters; then the round anchor, the outer velocity).
pub(super) fn parameters_only(contribution: &[f32]) -> Vec<f32> {
    contribution[..contribution.len() / 3].to_vec()
}

/// A `diloco` contribution's outer change: its round start (the second of its three parts)
/// minus its parameters (the first), what a ring of members sharing the start sums.
pub(super) fn outer_change(contribution: &[f32]) -> Vec<f32> {
    let numel = contribution.len() / 3;
    let (params, rest) = contribution.split_at(numel);
    params
        .iter()
        .zip(&rest[..numel])
        .map(|(p, s)| s - p)
        .collect()
}

/// The parameters a round of outer changes leaves: the round start in this member's
/// `contribution` (the members' own, which they share) minus the mean change. The trainer
/// then takes its outer step from that start towards them, as from a mean of parameters.
pub(super) fn parameters_after(contribution: &[f32], mean_change: &[f32]) -> Vec<f32> {
    let numel = contribution.len() / 3;
    contribution[numel..2 * numel]
        .iter()
        .zip(mean_change)
        .map(|(s, c)| s - c)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parts are read where they lie, and the parameters a member's own change leaves
    /// are its own parameters.
    #[test]
    fn a_contributions_parts_and_its_own_change_round_trip() {
        let contribution = [1.0, 2.0, 5.0, 7.0, 0.5, 0.25];
        assert_eq!(parameters_only(&contribution), [1.0, 2.0]);
        let change = outer_change(&contribution);
        assert_eq!(change, [4.0, 5.0]);
        assert_eq!(parameters_after(&contribution, &change), [1.0, 2.0]);
        assert_eq!(
            parameters_after(&contribution, &[0.0, 0.0]),
            [5.0, 7.0],
            "the start"
        );
    }
}
