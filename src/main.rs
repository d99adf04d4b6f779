//! The `agentry` command line; everything but the allocator is in `agentry::cli`.

// The event pipeline allocates many small, short-lived JSON values; glibc's allocator
// spent a fifth of the server's time freeing them under load.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    agentry::cli::main()
}
