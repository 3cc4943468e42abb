mod driver;
mod properties;
mod queues;
mod sim;
mod wal_file;
