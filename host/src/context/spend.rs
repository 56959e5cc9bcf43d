//! What an invoke's calls to models may spend, carried on its context to
//! every request they make: each retry and each upstream of a pool takes
//! from it, so neither multiplies what was granted.
//!
//! - The request's tree ([`Tree`]): the requests to model servers that one
//!   client request may cause, across every gateway it passes through. A
//!   gateway's request starts with what its client's `x-shallot-budget`
//!   grants (never more than the gateway's own bound); each request to a
//!   model takes one, and lends the server half of what is left, which a
//!   gateway answers with what it did not spend. However wide a loop of
//!   side calls fans out, the tree sends no more than the first request
//!   carried.
//! - A side call's tokens ([`Tokens`]): what a filter's `model` grant has
//!   left in its hook call. Each attempt reserves the call's worst case
//!   (its prompt, estimated, and its `max_tokens`) before it leaves, and
//!   is settled at what it cost: what the model reports for an answer, the
//!   prompt for a failure the server answered, nothing for one that never
//!   reached it, the whole reservation when it is not known (a timeout, an
//!   answer that could not be read).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

/// The requests to model servers a request's tree may still send from
/// here.
#[derive(Debug)]
pub struct Tree {
    left: AtomicU64,
}

impl Tree {
    /// A tree that may send `requests`.
    pub fn new(requests: u64) -> Self {
        Tree {
            left: AtomicU64::new(requests),
        }
    }

    /// What it may still send.
    pub fn left(&self) -> u64 {
        self.left.load(Ordering::Acquire)
    }

    /// Takes one request, and lends the server half of what is left after
    /// it (what a gateway there may spend): the loan, or `None` when
    /// nothing is left.
    pub fn take(&self) -> Option<u64> {
        let mut lent = 0;
        self.left
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                let after = left.checked_sub(1)?;
                lent = after / 2;
                Some(after - lent)
            })
            .ok()
            .map(|_| lent)
    }

    /// Takes back what a server did not spend of a loan.
    pub fn give_back(&self, unspent: u64) {
        self.left.fetch_add(unspent, Ordering::AcqRel);
    }
}

/// What an attempt that failed cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cost {
    /// It never reached the server.
    Nothing,
    /// The server read the prompt and refused or failed it.
    Prompt,
    /// Not known: the server may have answered in full.
    Reserved,
}

/// A side call's tokens: what its grant has left, and the worst case of
/// one attempt.
#[derive(Debug)]
pub struct Tokens {
    prompt: u64,
    most: u64,
    state: Mutex<Held>,
}

#[derive(Debug)]
struct Held {
    /// Tokens of the grant not spent nor reserved.
    left: u64,
    /// Reserved by an attempt not settled yet.
    reserved: u64,
    /// Spent so far.
    spent: u64,
}

impl Tokens {
    /// A side call whose prompt is about `prompt` tokens and whose answer
    /// is at most `most`, under a grant with `left` tokens.
    pub fn new(left: u64, prompt: u64, most: u64) -> Self {
        Tokens {
            prompt,
            most,
            state: Mutex::new(Held {
                left,
                reserved: 0,
                spent: 0,
            }),
        }
    }

    fn held(&self) -> MutexGuard<'_, Held> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserves an attempt's worst case, or says why the grant cannot pay
    /// for it. An attempt still reserved (an answer that came but could
    /// not be used, before a pool tries the next upstream) is spent first.
    pub fn reserve(&self) -> Result<(), String> {
        let mut held = self.held();
        held.spent += std::mem::take(&mut held.reserved);
        let worst = self.prompt + self.most;
        if held.left < worst {
            return Err(format!(
                "the side call's grant has {} tokens left, not the {worst} another attempt may cost",
                held.left
            ));
        }
        held.left -= worst;
        held.reserved = worst;
        Ok(())
    }

    /// Settles an attempt that failed at what it cost.
    pub fn failed(&self, cost: Cost) {
        let mut held = self.held();
        let reserved = std::mem::take(&mut held.reserved);
        let spent = match cost {
            Cost::Nothing => 0,
            Cost::Prompt => self.prompt.min(reserved),
            Cost::Reserved => reserved,
        };
        held.spent += spent;
        held.left += reserved - spent;
    }

    /// Settles the call's answer at what the model says it spent (its
    /// prompt and answer, estimated where it says nothing): against the
    /// attempt's reservation, or, from a model that reserves nothing (one
    /// in the process), at once.
    pub fn answered(&self, spent: u64) {
        let mut held = self.held();
        let reserved = std::mem::take(&mut held.reserved);
        held.spent += spent;
        held.left = (held.left + reserved).saturating_sub(spent);
    }

    /// Settles a call that failed: an attempt still reserved is spent.
    pub fn abandoned(&self) {
        self.failed(Cost::Reserved);
    }

    /// The tokens the call spent.
    pub fn spent(&self) -> u64 {
        self.held().spent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_lends_half_of_what_is_left_and_ends_at_zero() {
        let tree = Tree::new(10);
        assert_eq!(tree.take(), Some(4), "one taken, half of nine lent");
        assert_eq!(tree.left(), 5);
        tree.give_back(4);
        assert_eq!(tree.left(), 9);
        let mut sent = 0;
        while tree.take().is_some() {
            sent += 1;
        }
        assert_eq!((sent, tree.left()), (4, 0), "9, 4, 2, 1: every loan kept");
    }

    #[test]
    fn an_attempt_reserves_its_worst_case_and_is_settled_at_its_cost() {
        let tokens = Tokens::new(1000, 100, 300);
        tokens.reserve().unwrap();
        tokens.failed(Cost::Prompt);
        assert_eq!(tokens.spent(), 100);
        tokens.reserve().unwrap();
        tokens.failed(Cost::Nothing);
        tokens.reserve().unwrap();
        tokens.answered(150);
        assert_eq!(tokens.spent(), 250);
        let refused = tokens.reserve().and_then(|()| tokens.reserve());
        assert!(refused.is_err(), "750 left pays for one more, not two");
        tokens.abandoned();
        assert_eq!(tokens.spent(), 650, "the one reserved is spent");
    }

    #[test]
    fn an_answer_that_came_but_was_not_used_is_spent_when_the_next_attempt_reserves() {
        let tokens = Tokens::new(1000, 100, 300);
        tokens.reserve().unwrap();
        tokens.reserve().unwrap();
        tokens.answered(120);
        assert_eq!(tokens.spent(), 400 + 120);
    }

    #[test]
    fn a_model_in_the_process_is_charged_what_it_reports() {
        let tokens = Tokens::new(1000, 100, 300);
        tokens.answered(2000);
        assert_eq!(tokens.spent(), 2000, "charged whatever it reports");
        assert!(tokens.reserve().is_err());
    }
}
