mod drain;
mod driver;
mod membership;
mod properties;
mod queues;
mod sim;
mod snapshots;
mod wal_file;
