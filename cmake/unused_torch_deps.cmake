# Libraries LibTorch lists but never calls, left unloaded.
#
# Debian's libtorch_cpu.so names OpenCV, FFmpeg, ZeroMQ, LevelDB and LMDB among its NEEDED libraries (for
# Caffe2's image, video and database operators) without referencing a single symbol of theirs: they were
# linked without --as-needed. Loading them pulls in ~200 more shared libraries (GDAL, Qt, GStreamer,
# Poppler, the video codecs...): 291 libraries in all for the `capsnet` executable, ~66 MB of resident
# memory before main() and ~0.1 s of start-up in every process (docs/kernels.md, "Libraries LibTorch never calls").
#
# For each such library this builds an empty shared library with the same soname (here, in
# ${CMAKE_BINARY_DIR}/unused_torch_deps/) and capsnet_skip_unused_torch_deps(target) links it into an
# executable, ahead of LibTorch. The dynamic loader takes a NEEDED entry whose soname is already loaded as
# satisfied, so the real library and everything it pulls in are never mapped. Only libraries that
# libtorch_cpu references no symbol of are replaced (checked here with nm); the test
# build.unused_torch_deps_resolve checks with `ldd -r` that nothing the executable loads lacks a symbol.
# -DCAPSNET_SKIP_UNUSED_TORCH_DEPS=OFF turns it off; with a LibTorch that lists none of these (PyTorch 2.x
# wheels), it does nothing.

option(CAPSNET_SKIP_UNUSED_TORCH_DEPS "Do not load the libraries LibTorch lists but never calls (OpenCV, FFmpeg...)" ON)

set(CAPSNET_UNUSED_TORCH_DEPS "")
if(CAPSNET_SKIP_UNUSED_TORCH_DEPS AND CMAKE_SYSTEM_NAME STREQUAL "Linux" AND CMAKE_READELF AND CMAKE_NM)
  find_library(CAPSNET_TORCH_CPU_LIBRARY NAMES torch_cpu HINTS ${TORCH_INSTALL_PREFIX}/lib)
endif()
if(CAPSNET_TORCH_CPU_LIBRARY)
  get_filename_component(torch_cpu_file ${CAPSNET_TORCH_CPU_LIBRARY} REALPATH)
  execute_process(COMMAND ${CMAKE_READELF} -dW ${torch_cpu_file} OUTPUT_VARIABLE dynamic_section)
  string(REGEX MATCHALL "\\(NEEDED\\)[^\n]*\\[[^]\n]+\\]" needed_lines "${dynamic_section}")
  set(dir ${CMAKE_BINARY_DIR}/unused_torch_deps)
  file(MAKE_DIRECTORY ${dir})
  # What libtorch_cpu.so imports, one name per line, without symbol versions.
  execute_process(COMMAND sh -c "'${CMAKE_NM}' -D --undefined-only --format=posix '${torch_cpu_file}' | cut -d' ' -f1 | sed 's/@.*//' | sort -u > '${dir}/torch_cpu_imports.txt'"
                  RESULT_VARIABLE nm_result)
  if(NOT nm_result EQUAL 0)
    set(needed_lines "")
  endif()
  # Written only when its content changes (file(CONFIGURE)): a rewrite at every configure relinked every executable.
  file(CONFIGURE OUTPUT ${dir}/empty.cpp
       CONTENT "// An empty library standing in for one LibTorch lists but never calls (cmake/unused_torch_deps.cmake).\n")
  foreach(line IN LISTS needed_lines)
    string(REGEX REPLACE ".*\\[(.+)\\]" "\\1" soname "${line}")
    if(NOT soname MATCHES "^lib(opencv_[a-z0-9_]+|avcodec|avformat|avutil|swscale|swresample|zmq|leveldb|lmdb)\\.so\\.")
      continue()
    endif()
    find_library(real_${soname} NAMES ${soname})
    if(NOT real_${soname})
      continue()
    endif()
    # Replaced only if libtorch_cpu imports nothing the real library defines.
    execute_process(COMMAND sh -c "'${CMAKE_NM}' -D --defined-only --format=posix '${real_${soname}}' | cut -d' ' -f1 | sed 's/@.*//' | sort -u | comm -12 - '${dir}/torch_cpu_imports.txt' | wc -l"
                    OUTPUT_VARIABLE shared_symbols OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE nm_result)
    if(NOT nm_result EQUAL 0 OR NOT shared_symbols STREQUAL "0")
      message(STATUS "capsnet: LibTorch uses ${soname} (${shared_symbols} symbols): it stays loaded")
      continue()
    endif()
    string(MAKE_C_IDENTIFIER "capsnet_unused_${soname}" target)
    string(REGEX MATCH "^[^.]+" stem "${soname}")
    string(REGEX REPLACE "^[^.]+" "" suffix "${soname}")
    add_library(${target} SHARED ${dir}/empty.cpp)
    set_target_properties(${target} PROPERTIES PREFIX "" OUTPUT_NAME ${stem} SUFFIX ${suffix} NO_SONAME ON
                          LIBRARY_OUTPUT_DIRECTORY ${dir})
    target_link_options(${target} PRIVATE "LINKER:-soname,${soname}")
    list(APPEND CAPSNET_UNUSED_TORCH_DEPS ${target})
  endforeach()
  list(LENGTH CAPSNET_UNUSED_TORCH_DEPS count)
  if(count)
    message(STATUS "capsnet: ${count} libraries LibTorch lists but never calls are left unloaded (cmake/unused_torch_deps.cmake)")
  endif()
endif()

# Links the empty stand-ins into `target` (an executable), so that the real libraries are not loaded.
function(capsnet_skip_unused_torch_deps target)
  if(CAPSNET_UNUSED_TORCH_DEPS)
    target_link_options(${target} PRIVATE "LINKER:--no-as-needed")
    target_link_libraries(${target} PRIVATE ${CAPSNET_UNUSED_TORCH_DEPS})
  endif()
endfunction()
