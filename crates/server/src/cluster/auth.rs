//! Mutual authentication of a cluster connection before any Raft message is read: both sides
//! prove they hold the shared secret with an HMAC-SHA256 over both node ids and both sides'
//! fresh nonces, under a different label per side (so one side's proof cannot be replayed as
//! the other's). raft-rs's protobuf decoder has a known flaw on crafted input and raft-rs panics
//! on contradictory messages: only members may reach them.
//!
//! The dialer sends `magic, its id, the id it dialed, its nonce`; the listener answers `magic,
//! its id, its nonce, its proof`; the dialer checks it and sends its own proof; the listener
//! checks that and answers one byte, `ACCEPTED`. Every message has a fixed size. Without
//! cluster TLS (`super::link_tls`, inside which this runs) the stream is not encrypted or
//! integrity-protected afterwards: the cluster network must then be private.

use std::collections::BTreeMap;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use warren_replication::NodeId;

type HmacSha256 = Hmac<Sha256>;

const MAGIC: [u8; 8] = *b"WRNRAFT1";
/// A node that asks to join the cluster dials with this one: a node that does not know it
/// yet takes the link (for the request to join alone; see `JOIN_REQUEST`).
const MAGIC_JOIN: [u8; 8] = *b"WRNJOIN1";
const NONCE: usize = 32;
const PROOF: usize = 32;
const ACCEPTED: u8 = 1;
const DIALER: &[u8] = b"warren cluster dialer proof";
const LISTENER: &[u8] = b"warren cluster listener proof";

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a Warren cluster connection")]
    Magic,
    #[error(
        "the peer uses TLS on cluster links and this node does not: give every node \
         --cluster-tls-cert, --cluster-tls-key and --cluster-tls-ca"
    )]
    PeerUsesTls,
    #[error("node {0} is not a member of this cluster")]
    NotMember(NodeId),
    #[error("expected node {expected}, found node {found}")]
    WrongNode { expected: NodeId, found: NodeId },
    #[error("proof does not match the cluster secret")]
    BadProof,
    #[error("the peer refused this node")]
    Refused,
    #[error("node {node}: {why}")]
    Vetoed { node: NodeId, why: String },
    #[error("no random nonce: {0}")]
    Random(getrandom::Error),
    #[error("unusable cluster secret")]
    Secret,
}

fn nonce() -> Result<[u8; NONCE], AuthError> {
    let mut n = [0u8; NONCE];
    getrandom::getrandom(&mut n).map_err(AuthError::Random)?;
    Ok(n)
}

fn proof(
    secret: &[u8],
    label: &[u8],
    dialer: NodeId,
    listener: NodeId,
    dialer_nonce: &[u8; NONCE],
    listener_nonce: &[u8; NONCE],
) -> Result<HmacSha256, AuthError> {
    // HMAC takes keys of any length; the error exists for other MACs.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(secret).map_err(|_| AuthError::Secret)?;
    mac.update(label);
    mac.update(&dialer.to_be_bytes());
    mac.update(&listener.to_be_bytes());
    mac.update(dialer_nonce);
    mac.update(listener_nonce);
    Ok(mac)
}

fn id_at(b: &[u8], at: usize) -> NodeId {
    let mut id = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        id.copy_from_slice(s);
    }
    NodeId::from_be_bytes(id)
}

/// TLS record types that open what a TLS peer sends a plain one: a client's hello (a handshake
/// record), a server's refusal of a plain hello (an alert).
const TLS_HANDSHAKE: u8 = 0x16;
const TLS_ALERT: u8 = 0x15;

/// Whether `b` starts with a TLS record of type `kind` (the record's version is 3.x).
fn speaks_tls(b: &[u8], kind: u8) -> bool {
    matches!(b, [k, 3, ..] if *k == kind)
}

/// Reads until `buf` is full or the stream ends; how much came.
async fn read_up_to<S: AsyncRead + Unpin>(s: &mut S, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        let Some(rest) = buf.get_mut(got..) else {
            break;
        };
        match s.read(rest).await? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}

/// The dialing side: proves itself to `peer` and checks it is `peer`.
pub async fn dial<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    secret: &[u8],
    me: NodeId,
    peer: NodeId,
    joining: bool,
) -> Result<(), AuthError> {
    let mine = nonce()?;
    let mut hello = Vec::with_capacity(8 + 16 + NONCE);
    hello.extend_from_slice(if joining { &MAGIC_JOIN } else { &MAGIC });
    hello.extend_from_slice(&me.to_be_bytes());
    hello.extend_from_slice(&peer.to_be_bytes());
    hello.extend_from_slice(&mine);
    s.write_all(&hello).await?;
    // Over TLS a record may wait in the stream's buffer until flushed (a no-op for TCP).
    s.flush().await?;
    let mut answer = [0u8; 8 + 8 + NONCE + PROOF];
    let got = read_up_to(s, &mut answer).await?;
    if got < answer.len() {
        // A TLS listener answers a plain hello with an alert record, then closes.
        return Err(if speaks_tls(&answer[..got], TLS_ALERT) {
            AuthError::PeerUsesTls
        } else {
            AuthError::Refused
        });
    }
    let (magic, rest) = answer.split_at(8);
    if magic != MAGIC {
        return Err(if speaks_tls(magic, TLS_ALERT) {
            AuthError::PeerUsesTls
        } else {
            AuthError::Magic
        });
    }
    let found = id_at(rest, 0);
    if found != peer {
        return Err(AuthError::WrongNode {
            expected: peer,
            found,
        });
    }
    let mut theirs = [0u8; NONCE];
    theirs.copy_from_slice(&rest[8..8 + NONCE]);
    proof(secret, LISTENER, me, peer, &mine, &theirs)?
        .verify_slice(&rest[8 + NONCE..])
        .map_err(|_| AuthError::BadProof)?;
    let own = proof(secret, DIALER, me, peer, &mine, &theirs)?
        .finalize()
        .into_bytes();
    s.write_all(&own).await?;
    s.flush().await?;
    let mut verdict = [0u8; 1];
    match s.read_exact(&mut verdict).await {
        Ok(_) if verdict[0] == ACCEPTED => Ok(()),
        Ok(_) => Err(AuthError::Refused),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(AuthError::Refused),
        Err(e) => Err(e.into()),
    }
}

/// The listening side: returns the member that proved itself, once `vet` accepts it too (the
/// dialer is told it was refused otherwise). Says nothing to a stranger (no proof of ours for a
/// node id that is not a member), unless it dialed as a node asking to join: it is taken once
/// it proved the secret (what it sends then counts only as a request to join), without `vet`,
/// which has no address to check it against (with cluster TLS, the CA still vouches for it).
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin, A>(
    s: &mut S,
    secret: &[u8],
    me: NodeId,
    members: &BTreeMap<NodeId, A>,
    vet: impl FnOnce(NodeId) -> Result<(), String>,
) -> Result<NodeId, AuthError> {
    let mut hello = [0u8; 8 + 16 + NONCE];
    s.read_exact(&mut hello).await?;
    let (magic, rest) = hello.split_at(8);
    let joining = magic == MAGIC_JOIN;
    if magic != MAGIC && !joining {
        return Err(if speaks_tls(magic, TLS_HANDSHAKE) {
            AuthError::PeerUsesTls
        } else {
            AuthError::Magic
        });
    }
    let (from, to) = (id_at(rest, 0), id_at(rest, 8));
    if to != me {
        return Err(AuthError::WrongNode {
            expected: me,
            found: to,
        });
    }
    let member = members.contains_key(&from);
    if from == me || from == 0 || (!member && !joining) {
        return Err(AuthError::NotMember(from));
    }
    let mut theirs = [0u8; NONCE];
    theirs.copy_from_slice(&rest[16..16 + NONCE]);
    let mine = nonce()?;
    let mut answer = Vec::with_capacity(8 + 8 + NONCE + PROOF);
    answer.extend_from_slice(&MAGIC);
    answer.extend_from_slice(&me.to_be_bytes());
    answer.extend_from_slice(&mine);
    answer.extend_from_slice(
        &proof(secret, LISTENER, from, me, &theirs, &mine)?
            .finalize()
            .into_bytes(),
    );
    s.write_all(&answer).await?;
    s.flush().await?;
    let mut their_proof = [0u8; PROOF];
    s.read_exact(&mut their_proof).await?;
    proof(secret, DIALER, from, me, &theirs, &mine)?
        .verify_slice(&their_proof)
        .map_err(|_| AuthError::BadProof)?;
    if member {
        vet(from).map_err(|why| AuthError::Vetoed { node: from, why })?;
    }
    s.write_all(&[ACCEPTED]).await?;
    s.flush().await?;
    Ok(from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;

    fn members(ids: &[NodeId]) -> BTreeMap<NodeId, SocketAddr> {
        ids.iter()
            .map(|id| (*id, SocketAddr::from(([127, 0, 0, 1], 1000 + *id as u16))))
            .collect()
    }

    async fn pair(
        dial_secret: &[u8],
        accept_secret: &[u8],
        dialer: NodeId,
        dialed: NodeId,
        listener: NodeId,
        known: &[NodeId],
    ) -> (Result<(), AuthError>, Result<NodeId, AuthError>) {
        pair_as(
            dial_secret,
            accept_secret,
            dialer,
            dialed,
            listener,
            known,
            false,
        )
        .await
    }

    async fn pair_as(
        dial_secret: &[u8],
        accept_secret: &[u8],
        dialer: NodeId,
        dialed: NodeId,
        listener: NodeId,
        known: &[NodeId],
        joining: bool,
    ) -> (Result<(), AuthError>, Result<NodeId, AuthError>) {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let known = members(known);
        let (d, l) = tokio::join!(
            async {
                let r = dial(&mut a, dial_secret, dialer, dialed, joining).await;
                drop(a);
                r
            },
            async {
                let r = accept(&mut b, accept_secret, listener, &known, |_| Ok(())).await;
                drop(b);
                r
            }
        );
        (d, l)
    }

    /// A plain node meeting a TLS one is told so, on either side of the link.
    #[tokio::test]
    async fn a_tls_peer_is_recognised_from_its_first_bytes() {
        let s = b"0123456789abcdef";
        // What a TLS 1.3 dialer sends first: a handshake record (a ClientHello).
        let mut hello = vec![0x16, 0x03, 0x01, 0x02, 0x00, 0x01];
        hello.resize(8 + 16 + NONCE, 0);
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&hello).await.unwrap();
        let l = accept(&mut b, s, 1, &members(&[2, 3]), |_| Ok(())).await;
        assert!(matches!(l, Err(AuthError::PeerUsesTls)), "{l:?}");
        // What a TLS listener answers a plain hello: an alert record, then the end.
        let (mut a, mut b) = tokio::io::duplex(1024);
        let listener = async move {
            let mut hello = [0u8; 8 + 16 + NONCE];
            b.read_exact(&mut hello).await.unwrap();
            b.write_all(&[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x0a])
                .await
                .unwrap();
        };
        let (d, ()) = tokio::join!(dial(&mut a, s, 2, 1, false), listener);
        assert!(matches!(d, Err(AuthError::PeerUsesTls)), "{d:?}");
    }

    #[tokio::test]
    async fn members_with_the_secret_authenticate_each_other() {
        let (d, l) = pair(b"0123456789abcdef", b"0123456789abcdef", 2, 1, 1, &[2, 3]).await;
        assert!(d.is_ok(), "{d:?}");
        assert_eq!(l.unwrap(), 2);
    }

    #[tokio::test]
    async fn a_wrong_secret_fails_on_both_sides() {
        let (d, l) = pair(b"0123456789abcdef", b"fedcba9876543210", 2, 1, 1, &[2, 3]).await;
        assert!(matches!(d, Err(AuthError::BadProof)), "{d:?}");
        assert!(l.is_err());
    }

    #[tokio::test]
    async fn a_stranger_or_the_wrong_node_is_refused() {
        let s = b"0123456789abcdef";
        // Node 4 is no member of node 1's cluster.
        let (d, l) = pair(s, s, 4, 1, 1, &[2, 3]).await;
        assert!(matches!(d, Err(AuthError::Refused)), "{d:?}");
        assert!(matches!(l, Err(AuthError::NotMember(4))), "{l:?}");
        // Node 2 dials what it believes is node 3 and reaches node 1.
        let (d, l) = pair(s, s, 2, 3, 1, &[2, 3]).await;
        assert!(d.is_err());
        assert!(matches!(
            l,
            Err(AuthError::WrongNode {
                expected: 1,
                found: 3
            })
        ));
    }

    /// A node asking to join is taken with the secret, though no member; without the secret
    /// it is not.
    #[tokio::test]
    async fn a_node_asking_to_join_is_taken_once_it_proves_the_secret() {
        let s = b"0123456789abcdef";
        let (d, l) = pair_as(s, s, 4, 1, 1, &[2, 3], true).await;
        assert!(d.is_ok(), "{d:?}");
        assert_eq!(l.unwrap(), 4);
        let (d, l) = pair_as(b"fedcba9876543210", s, 4, 1, 1, &[2, 3], true).await;
        assert!(matches!(d, Err(AuthError::BadProof)), "{d:?}");
        assert!(l.is_err());
    }

    #[tokio::test]
    async fn a_proof_made_without_the_secret_is_refused_on_either_side() {
        let s = b"0123456789abcdef";
        // A dialer that ignores the listener's proof and sends one it made up.
        let (mut a, mut b) = tokio::io::duplex(1024);
        let known = members(&[2, 3]);
        let (verdict, l) = tokio::join!(
            async {
                let mut hello = MAGIC.to_vec();
                hello.extend_from_slice(&2u64.to_be_bytes());
                hello.extend_from_slice(&1u64.to_be_bytes());
                hello.extend_from_slice(&[7; NONCE]);
                a.write_all(&hello).await.unwrap();
                let mut answer = [0u8; 8 + 8 + NONCE + PROOF];
                a.read_exact(&mut answer).await.unwrap();
                a.write_all(&[0; PROOF]).await.unwrap();
                let mut v = Vec::new();
                a.read_to_end(&mut v).await.unwrap();
                v
            },
            async {
                let r = accept(&mut b, s, 1, &known, |_| Ok(())).await;
                drop(b);
                r
            }
        );
        assert!(matches!(l, Err(AuthError::BadProof)), "{l:?}");
        assert!(verdict.is_empty(), "no ACCEPTED for a made-up proof");
        // A listener that answers with a made-up proof.
        let (mut a, mut b) = tokio::io::duplex(1024);
        let (d, ()) = tokio::join!(dial(&mut a, s, 2, 1, false), async move {
            let mut hello = [0u8; 8 + 16 + NONCE];
            b.read_exact(&mut hello).await.unwrap();
            let mut answer = MAGIC.to_vec();
            answer.extend_from_slice(&1u64.to_be_bytes());
            answer.extend_from_slice(&[9; NONCE + PROOF]);
            b.write_all(&answer).await.unwrap();
            drop(b);
        });
        assert!(matches!(d, Err(AuthError::BadProof)), "{d:?}");
    }
}
