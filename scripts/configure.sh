# Sourced by the build scripts: `configure DIR CMAKE_ARGS...` configures a build folder.
# A new folder gets Ninja: it compiles a library's files while the libraries it links are
# still being archived, where Make waits for each library in turn (the ASan build: 281 s
# against 443 s on two cores). A folder configured before keeps its generator, since CMake
# cannot change it in place; delete the folder to move it to Ninja. Without ninja on the
# PATH, CMake's default generator.
configure() {
  local dir=$1
  shift
  local generator=()
  if [ ! -f "$dir/CMakeCache.txt" ] && command -v ninja >/dev/null; then generator=(-G Ninja); fi
  cmake "${generator[@]}" "$@" -B "$dir" >/dev/null
}
