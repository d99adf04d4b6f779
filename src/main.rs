//! The `agentry` command line; everything but the allocator is in `agentry::cli`.

// The event pipeline allocates many small, short-lived JSON values; glibc's allocator
// spent a fifth of the server's time freeing them under load.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    // SAFETY: `mi_collect` only walks the calling thread's own heap and the arenas, which
    // mimalloc locks; it takes no pointer.
    agentry::server::on_release_freed(|| unsafe { libmimalloc_sys::mi_collect(true) });
    agentry::cli::main()
}
