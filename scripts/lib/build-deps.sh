# Shared by scripts/run and scripts/test: what building Warren needs besides Rust.
# RocksDB's Rust bindings are generated with libclang at build time, and its C++ is compiled with c++.

have_root_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }

# bindgen loads libclang's C API: libclang.so[.N] or libclang-N.so[.N] (Debian's libclang1-N package).
# libclang-cpp.so.N (the C++ API, which some machines have without the C one) does not do.
have_libclang() {
    [ -n "${LIBCLANG_PATH:-}" ] && return 0
    command -v c++ >/dev/null 2>&1 || return 1
    local lib
    for lib in /usr/lib/llvm-*/lib/libclang* /usr/lib/*/libclang* /usr/lib/libclang*; do
        case "${lib##*/}" in
        libclang.so | libclang.so.* | libclang-[0-9]*.so | libclang-[0-9]*.so.*) return 0 ;;
        esac
    done
    return 1
}

install_build_deps() {
    have_libclang && { echo "libclang and a C++ compiler found"; return 0; }
    if have_root_apt; then
        echo "libclang is missing (RocksDB's bindings need it): installing clang libclang-dev g++ with apt-get"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq clang libclang-dev g++ >/dev/null
    fi
    have_libclang || {
        echo "RocksDB's build needs clang, libclang and a C++ compiler: install them (Debian/Ubuntu:"
        echo "  sudo apt-get install clang libclang-dev g++), or point LIBCLANG_PATH at libclang's directory"
        return 1
    }
}
