# build.unused_torch_deps_resolve (cmake/unused_torch_deps.cmake): the executable EXE loads the empty
# stand-ins of DIR instead of the libraries LibTorch lists but never calls, and `ldd -r` (which performs
# every relocation, functions included, as BIND_NOW would) finds no symbol missing: no library it loads
# needed one of the replaced libraries after all.
#   cmake -DEXE=... -DDIR=... -DSTANDINS="libopencv_core.so.406;..." -P check_unused_torch_deps.cmake
execute_process(COMMAND ldd -r ${EXE} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ldd -r ${EXE} failed (${rc}):\n${out}${err}")
endif()
string(REGEX MATCHALL "[^\n]*(undefined symbol|not found)[^\n]*" missing "${out}\n${err}")
if(missing)
  string(REPLACE ";" "\n" missing "${missing}")
  message(FATAL_ERROR "${EXE} lacks symbols or libraries: a replaced library is used after all "
                      "(configure with -DCAPSNET_SKIP_UNUSED_TORCH_DEPS=OFF, and narrow the pattern in "
                      "cmake/unused_torch_deps.cmake):\n${missing}")
endif()
if(NOT STANDINS)
  message(STATUS "no stand-ins configured: nothing replaced")
  return()
endif()
set(loaded 0)
foreach(soname IN LISTS STANDINS)
  string(REPLACE "." "\\." pattern "${soname}")
  if(NOT out MATCHES "${pattern} => ${DIR}/${pattern}")
    message(FATAL_ERROR "${soname} is not loaded from ${DIR}:\n${out}")
  endif()
  math(EXPR loaded "${loaded} + 1")
endforeach()
# The real libraries' own dependencies are gone too (GDAL stands for all of them).
if(out MATCHES "libgdal")
  message(FATAL_ERROR "libgdal is still loaded:\n${out}")
endif()
string(REGEX MATCHALL "=>" lines "${out}")
list(LENGTH lines count)
message(STATUS "${loaded} stand-ins loaded; ${count} shared libraries in all")
