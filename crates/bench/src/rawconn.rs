//! A minimal AMQP 0-9-1 client for the idle-connections mode: handshake, one channel, heartbeats
//! and close, on one tokio task per connection.
//!
//! lapin spends an OS thread and about 8 MB of buffers on every connection, which would make the
//! load generator, not the broker, the thing measured with 1,000 connections on a small machine.
//! This client negotiates exactly what lapin would (the broker's channel-max, frame-max and
//! heartbeat), so the broker sees an ordinary idle client.

use std::time::Duration;

use lapin::uri::AMQPUri;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::run::BoxError;

const FRAME_METHOD: u8 = 1;
const FRAME_HEARTBEAT: u8 = 8;
const FRAME_END: u8 = 0xCE;

/// Where and as whom to connect, from an amqp:// URL.
#[derive(Debug, Clone)]
pub struct Target {
    pub addr: String,
    pub user: String,
    pub password: String,
    pub vhost: String,
}

impl Target {
    pub fn from_url(url: &str) -> Result<Self, BoxError> {
        let uri: AMQPUri = url.parse().map_err(|e: String| e)?;
        Ok(Self {
            addr: format!("{}:{}", uri.authority.host, uri.authority.port),
            user: uri.authority.userinfo.username.clone(),
            password: uri.authority.userinfo.password.clone(),
            vhost: uri.vhost.clone(),
        })
    }
}

/// Appends a method frame (class, method, arguments) to `out`.
pub fn method_frame(out: &mut Vec<u8>, channel: u16, class: u16, method: u16, args: &[u8]) {
    out.push(FRAME_METHOD);
    out.extend_from_slice(&channel.to_be_bytes());
    out.extend_from_slice(&(4 + args.len() as u32).to_be_bytes());
    out.extend_from_slice(&class.to_be_bytes());
    out.extend_from_slice(&method.to_be_bytes());
    out.extend_from_slice(args);
    out.push(FRAME_END);
}

fn shortstr(out: &mut Vec<u8>, s: &str) {
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

fn longstr(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
}

/// connection.start-ok with PLAIN credentials and a small client-properties table.
pub fn start_ok(user: &str, password: &str) -> Vec<u8> {
    let mut table = Vec::new();
    shortstr(&mut table, "product");
    table.push(b'S');
    longstr(&mut table, b"warren-bench");
    let mut args = Vec::new();
    longstr(&mut args, &table);
    shortstr(&mut args, "PLAIN");
    let mut response = vec![0];
    response.extend_from_slice(user.as_bytes());
    response.push(0);
    response.extend_from_slice(password.as_bytes());
    longstr(&mut args, &response);
    shortstr(&mut args, "en_US");
    let mut out = Vec::new();
    method_frame(&mut out, 0, 10, 11, &args);
    out
}

struct Frame {
    kind: u8,
    channel: u16,
    payload: Vec<u8>,
}

impl Frame {
    fn method(&self) -> Option<(u16, u16)> {
        if self.kind != FRAME_METHOD || self.payload.len() < 4 {
            return None;
        }
        let p = &self.payload;
        Some((
            u16::from_be_bytes([p[0], p[1]]),
            u16::from_be_bytes([p[2], p[3]]),
        ))
    }
}

async fn read_frame(stream: &mut TcpStream) -> Result<Frame, BoxError> {
    let mut header = [0u8; 7];
    stream.read_exact(&mut header).await?;
    let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
    if size > 1 << 20 {
        return Err(format!("frame of {size} bytes during an idle connection").into());
    }
    let mut payload = vec![0u8; size + 1];
    stream.read_exact(&mut payload).await?;
    if payload.pop() != Some(FRAME_END) {
        return Err("frame without frame-end".into());
    }
    Ok(Frame {
        kind: header[0],
        channel: u16::from_be_bytes([header[1], header[2]]),
        payload,
    })
}

/// Reads frames until the method `want` arrives; a connection.close is an error.
async fn expect(stream: &mut TcpStream, want: (u16, u16)) -> Result<Frame, BoxError> {
    loop {
        let f = read_frame(stream).await?;
        match f.method() {
            Some(m) if m == want => return Ok(f),
            Some((10, 50)) | Some((20, 40)) => {
                let code = f
                    .payload
                    .get(4..6)
                    .map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
                let text = f
                    .payload
                    .get(6)
                    .and_then(|&n| f.payload.get(7..7 + n as usize))
                    .map(|b| String::from_utf8_lossy(b).into_owned())
                    .unwrap_or_default();
                return Err(format!("broker closed: {code} {text}").into());
            }
            _ => {} // heartbeats and anything else are ignored during the handshake
        }
    }
}

/// An open connection with channel 1 open.
pub struct IdleConnection {
    stream: TcpStream,
    heartbeat: u16,
}

impl IdleConnection {
    pub async fn open(target: &Target) -> Result<Self, BoxError> {
        let mut stream = TcpStream::connect(&target.addr).await?;
        stream.set_nodelay(true)?;
        stream.write_all(b"AMQP\x00\x00\x09\x01").await?;
        expect(&mut stream, (10, 10)).await?;
        stream
            .write_all(&start_ok(&target.user, &target.password))
            .await?;
        let tune = expect(&mut stream, (10, 30)).await?;
        let p = &tune.payload;
        if p.len() < 12 {
            return Err("short connection.tune".into());
        }
        // Accept the broker's proposal, as lapin and most clients do.
        let (channel_max, frame_max, heartbeat) = (&p[4..6], &p[6..10], &p[10..12]);
        let heartbeat_secs = u16::from_be_bytes([heartbeat[0], heartbeat[1]]);
        let mut out = Vec::with_capacity(128);
        let mut args = Vec::new();
        args.extend_from_slice(channel_max);
        args.extend_from_slice(frame_max);
        args.extend_from_slice(heartbeat);
        method_frame(&mut out, 0, 10, 31, &args);
        let mut args = Vec::new();
        shortstr(&mut args, &target.vhost);
        shortstr(&mut args, "");
        args.push(0);
        method_frame(&mut out, 0, 10, 40, &args);
        stream.write_all(&out).await?;
        expect(&mut stream, (10, 41)).await?;
        out.clear();
        method_frame(&mut out, 1, 20, 10, &[0]);
        stream.write_all(&out).await?;
        expect(&mut stream, (20, 11)).await?;
        Ok(Self {
            stream,
            heartbeat: heartbeat_secs,
        })
    }

    /// Stays idle (answering and sending heartbeats) until `stop` turns true, then closes.
    pub async fn idle(mut self, mut stop: watch::Receiver<bool>) -> Result<(), BoxError> {
        const HEARTBEAT: [u8; 8] = [FRAME_HEARTBEAT, 0, 0, 0, 0, 0, 0, FRAME_END];
        let period = if self.heartbeat > 0 {
            Duration::from_secs_f64(f64::from(self.heartbeat) / 2.0)
        } else {
            Duration::from_secs(3600)
        };
        let mut tick = tokio::time::interval(period);
        tick.tick().await;
        loop {
            if *stop.borrow() {
                break;
            }
            tokio::select! {
                _ = stop.changed() => break,
                _ = tick.tick() => {
                    if self.heartbeat > 0 {
                        self.stream.write_all(&HEARTBEAT).await?;
                    }
                }
                f = read_frame(&mut self.stream) => {
                    let f = f?;
                    if f.kind == FRAME_HEARTBEAT {
                        continue;
                    }
                    if let Some((10, 50)) = f.method() {
                        let mut out = Vec::new();
                        method_frame(&mut out, 0, 10, 51, &[]);
                        let _ = self.stream.write_all(&out).await;
                        return Err(format!("broker closed the connection (channel {})", f.channel).into());
                    }
                }
            }
        }
        let mut out = Vec::new();
        let mut args = Vec::new();
        args.extend_from_slice(&200u16.to_be_bytes());
        shortstr(&mut args, "bye");
        args.extend_from_slice(&[0, 0, 0, 0]);
        method_frame(&mut out, 0, 10, 50, &args);
        self.stream.write_all(&out).await?;
        let _ =
            tokio::time::timeout(Duration::from_secs(5), expect(&mut self.stream, (10, 51))).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_are_well_formed() {
        let mut out = Vec::new();
        method_frame(&mut out, 1, 20, 10, &[0]);
        assert_eq!(out, [1, 0, 1, 0, 0, 0, 5, 0, 20, 0, 10, 0, 0xCE]);
        let so = start_ok("guest", "guest");
        // type, channel 0, size, class 10 method 11
        assert_eq!(&so[..3], &[1, 0, 0]);
        let size = u32::from_be_bytes([so[3], so[4], so[5], so[6]]) as usize;
        assert_eq!(so.len(), 7 + size + 1);
        assert_eq!(&so[7..11], &[0, 10, 0, 11]);
        assert!(so.windows(12).any(|w| w == b"\0guest\0guest"));
        assert_eq!(*so.last().unwrap(), 0xCE);
    }

    #[test]
    fn target_from_url() {
        let t = Target::from_url("amqp://u:p@localhost:5673/%2f").unwrap();
        assert_eq!(t.addr, "localhost:5673");
        assert_eq!((t.user.as_str(), t.password.as_str()), ("u", "p"));
        assert_eq!(t.vhost, "/");
    }
}
