mod properties;
mod sim;
mod wal_file;
